"""A/B inside real MaxText: the same training run as separate processes,
plugin off, plugin on, and (optionally) XLA's windowed einsum.

    python scripts/maxtext_ab.py --out DIR [--arms off,auto,windowed] \\
        -- <maxtext>/configs/base.yml key=value ...

It ends with one verdict line per arm: whether its losses match the
baseline's, and which arm is faster and by how much. On CPU devices the
step times do not measure the GPU overlap (the report and plot say so).

Each arm runs `python -m collective_matmul.integrations.maxtext` with the
MaxText arguments given (plus run_name, metrics_file and output directory)
under its own timeout, and the report compares MaxText's own per-step
metrics (`perf/step_time_seconds`, `learning/loss`). Written to DIR:
ab.json (everything, with the commands), report.md, ab.png, and each arm's
log and metrics. Exit status 1 when an arm fails or the losses differ by
more than the tolerance.

Step times of separate processes drift with the machine (on 2 x H200 the
same arm's median moved by up to 3 % between runs). With `--rounds R` every
arm runs R times, the order reversed every other round (off, a, b, then
b, a, off, ...), so a drift falls on all arms alike: an arm's step time is
the median over all its rounds' timed steps, and the report gives each
round's ratio as well. Only the first round is profiled.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import typing
import textwrap
import time

class NamedArm(typing.NamedTuple):
  """An arm --arms can name: what it is, and what it adds to the launch.
  (A NamedTuple, not a dataclass: the tests load this script by path
  without registering it in sys.modules, where a dataclass with string
  annotations fails.)"""
  description: str
  plugin_flags: tuple[str, ...] = ()
  xla_flags: str = ""


_AUTO = ("--use_collective_matmul", "--collective_matmul_impl=auto")
NAMED_ARMS = {
    "off": NamedArm("stock MaxText: plugin off, MaxText's XLA defaults (the "
                    "baseline)"),
    "auto": NamedArm("the plugin on, implementation picked per projection "
                     "(the Hopper kernels where they apply, else XLA's "
                     "collective + GEMM or, off Hopper, the portable ring)",
                     _AUTO),
    "ring": NamedArm("the plugin on, the portable ppermute ring everywhere "
                     "(any backend; for correctness, not speed)",
                     ("--use_collective_matmul",
                      "--collective_matmul_impl=ring")),
    "attn": NamedArm("plugin off, MaxText's GPU flash attention run per "
                     "shard of heads (--maxtext_shard_gpu_attention)",
                     ("--maxtext_shard_gpu_attention",)),
    "auto_attn": NamedArm("auto and attn together",
                          _AUTO + ("--maxtext_shard_gpu_attention",)),
    "windowed": NamedArm("plugin off, XLA's own windowed einsum (its "
                         "all-gather overlap) switched on through XLA_FLAGS",
                         xla_flags="--xla_gpu_threshold_for_windowed_einsum_"
                         "mib=0 --xla_gpu_multi_streamed_windowed_einsum="
                         "true"),
}
# name: (plugin flags, extra XLA_FLAGS)
ARMS = {name: (arm.plugin_flags, arm.xla_flags)
        for name, arm in NAMED_ARMS.items()}


def arms_help() -> str:
  """Every named arm: what it is and what it adds to the command."""
  lines = ["named arms (--arms):"]
  for name, arm in NAMED_ARMS.items():
    added = " ".join(arm.plugin_flags) + (
        f" XLA_FLAGS+={arm.xla_flags}" if arm.xla_flags else "")
    lines += textwrap.wrap(f"{name}: {arm.description}", 78,
                           initial_indent="  ", subsequent_indent="    ")
    lines += textwrap.wrap(f"adds: {added.strip() or '(nothing)'}", 78,
                           initial_indent="    ", subsequent_indent="      ",
                           break_on_hyphens=False)
  return "\n".join(lines)


WARMUP_STEPS = 2  # Compile and first-touch: not in the median.
PROFILE_AFTER = WARMUP_STEPS + 1  # With --profile_steps: the first profiled.
LOSS_RTOL = {"bfloat16": 2e-2, "float32": 1e-4}
_ARM_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def parse_arm(spec: str) -> tuple[str, tuple[str, ...], str]:
  """A named arm, or NAME=ARGS: ARGS' `--xla_*` flags go to XLA_FLAGS, its
  other `--` flags to the launcher (plugin flags) and its key=value
  arguments to MaxText, e.g.
  `auto_noscan=--use_collective_matmul scan_layers=False`. NAME names the
  arm's files and MaxText run: letters, digits, '_', '.' and '-'."""
  if not spec.split():
    raise ValueError(f"an empty arm: one of {sorted(ARMS)} or NAME=ARGS")
  if "=" not in spec.split()[0] or spec.split("=", 1)[0] in ARMS:
    if spec not in ARMS:
      raise ValueError(f"unknown arm {spec!r}: one of {sorted(ARMS)} or "
                       "NAME=ARGS")
    return spec, *ARMS[spec]
  name, args = spec.split("=", 1)
  if not _ARM_NAME.fullmatch(name):
    raise ValueError(f"arm {spec!r}: NAME before '=' must be letters, "
                     "digits, '_', '.' or '-'")
  args = args.split()
  xla = " ".join(a for a in args if a.startswith("--xla_"))
  return name, tuple(a for a in args if not a.startswith("--xla_")), xla


def run_arm(spec: str, maxtext_args: list[str], out: str, timeout: int,
            profile_steps: int = 0, tag: str = "") -> dict:
  """Runs one arm once; `tag` tells its files and MaxText run apart from
  the same arm's other rounds."""
  arm, flags, xla_flags = parse_arm(spec)
  run = f"{arm}{tag}"
  metrics = os.path.join(out, f"{run}.metrics.jsonl")
  if os.path.exists(metrics):
    os.remove(metrics)
  argv = [sys.executable, "-m", "collective_matmul.integrations.maxtext",
          *maxtext_args, f"run_name=ab_{run}",
          f"base_output_directory={os.path.join(out, 'runs')}",
          f"metrics_file={metrics}", *flags]
  if profile_steps:
    argv += ["profiler=xplane",
             f"skip_first_n_steps_for_profiler={PROFILE_AFTER}",
             f"profiler_steps={profile_steps}"]
  env = dict(os.environ)
  if xla_flags:
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
  started = time.time()
  with open(os.path.join(out, f"{run}.log"), "w") as log:
    try:
      rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                          timeout=timeout).returncode
    except subprocess.TimeoutExpired:
      rc = "timeout"
  with open(os.path.join(out, f"{run}.log")) as log:
    text = log.read()
  steps = []
  if os.path.exists(metrics):
    with open(metrics) as f:
      steps = [json.loads(line) for line in f]
  losses = [s["learning/loss"] for s in steps]
  times = [s["perf/step_time_seconds"] for s in steps]
  # Profiled steps carry the profiler's overhead: not in the median.
  profiled = range(PROFILE_AFTER, PROFILE_AFTER + profile_steps)
  timed = [t for i, t in enumerate(times)
           if i >= WARMUP_STEPS and i not in profiled]
  # The launcher's table: a summary line, then one indented line each.
  table = re.search(r"^collective matmul: \d+ of \d+ dot_generals "
                    r"rewritten\n((?:  .*\n)*)", text, re.M)
  table_start = table.start() if table else -1
  decisions = ([line.strip() for line in table.group(1).splitlines()]
               if table else [])
  profile = None
  if profile_steps and rc == 0:
    profile = _breakdown(os.path.join(out, "runs", f"ab_{run}"),
                         profile_steps)
  return {
      "profile": profile,
      "arm": arm, "rc": rc, "seconds": round(time.time() - started, 1),
      "command": " ".join(argv), "xla_flags": env.get("XLA_FLAGS", ""),
      "losses": losses, "step_times_s": times, "timed_step_times_s": timed,
      "median_step_ms": 1e3 * statistics.median(timed) if timed else None,
      "decisions": decisions,
      "decision_summary": (text[table_start:].splitlines()[0]
                           if table_start >= 0 else None),
  }


def round_orders(arms: list[str], rounds: int) -> list[list[str]]:
  """The arms' order in each round: as given, reversed every other round."""
  return [list(arms) if r % 2 == 0 else list(reversed(arms))
          for r in range(rounds)]


def merge_rounds(runs: list[dict]) -> dict:
  """One arm's runs (`run_arm`, in round order) as one result: the first
  round's profile, decisions, losses and commands; the median over every
  round's timed steps; the first failing round's rc; and each round's own
  figures under "rounds"."""
  if len(runs) == 1:
    return runs[0]
  timed = [t for run in runs for t in run["timed_step_times_s"]]
  merged = dict(runs[0])
  merged.update(
      rc=next((run["rc"] for run in runs if run["rc"] != 0), 0),
      seconds=round(sum(run["seconds"] for run in runs), 1),
      timed_step_times_s=timed,
      median_step_ms=1e3 * statistics.median(timed) if timed else None,
      rounds=[{key: run[key] for key in ("rc", "median_step_ms", "losses",
                                         "step_times_s", "command")}
              for run in runs])
  return merged


def _reference_host():
  """The reference_host package (installed, or from the checkout)."""
  try:
    import reference_host  # pylint: disable=g-import-not-at-top
  except ImportError:  # Not installed: from the checkout.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "host"))
    import reference_host  # pylint: disable=g-import-not-at-top
  return reference_host


def _profile_lib():
  _reference_host()
  from reference_host import profile  # pylint: disable=g-import-not-at-top
  return profile


def _checkpoint_lib():
  _reference_host()
  from reference_host import checkpoint  # pylint: disable=g-import-not-at-top
  return checkpoint


def _ab_lib():
  _reference_host()
  from reference_host import ab  # pylint: disable=g-import-not-at-top
  return ab


def _breakdown(run_dir: str, steps: int) -> dict:
  """The arm's GPU time breakdown from MaxText's xplane profile."""
  profile = _profile_lib()
  try:
    path = profile.find_trace(run_dir, "*.xplane.pb")
    return {"trace": path,
            **profile.breakdown(profile.load_events(path), steps).to_json()}
  except (FileNotFoundError, ValueError) as e:
    return {"error": str(e)}


def baseline_of(arm: str, baselines: dict[str, str]) -> str:
  """The arm `arm` is compared with: its `--compare` baseline, else off."""
  return baselines.get(arm, "off")


def profile_comparisons(arms: list[dict],
                        baselines: dict[str, str] | None = None
                        ) -> dict[str, dict]:
  """Each arm against its baseline (`--compare`, else `off`): what it hid
  and what its kernels cost."""
  profile = _profile_lib()
  by_name = {a["arm"]: a for a in arms}
  out = {}
  for arm in arms:
    base_name = baseline_of(arm["arm"], baselines or {})
    base = by_name[base_name].get("profile") or {}
    mine = arm.get("profile") or {}
    if arm["arm"] == base_name or "error" in mine or "error" in base or (
        not mine or not base):
      continue
    fields = {f.name for f in dataclasses.fields(profile.Breakdown)}
    load = lambda d: profile.Breakdown(**{k: v for k, v in d.items()
                                          if k in fields})
    out[arm["arm"]] = {"baseline": base_name,
                       **profile.compare(load(base), load(mine)).to_json()}
  return out


def compare(arms: list[dict], dtype: str,
            baselines: dict[str, str] | None = None) -> dict:
  by_name = {a["arm"]: a for a in arms}
  base = by_name["off"]
  rows = []
  rounds_of = lambda a: a.get("rounds") or [a]
  ok = all(r["rc"] == 0 and r["losses"] for a in arms for r in rounds_of(a))
  for arm in arms:
    # Every round's losses against the baseline's first round.
    diffs = [abs(losses[i] - base["losses"][i]) / abs(base["losses"][i])
             for losses in (r["losses"] for r in rounds_of(arm))
             for i in range(min(len(losses), len(base["losses"])))]
    max_diff = max(diffs) if diffs else None
    ratio = (arm["median_step_ms"] / base["median_step_ms"]
             if arm["median_step_ms"] and base["median_step_ms"] else None)
    same = max_diff is not None and max_diff <= LOSS_RTOL.get(dtype, 2e-2)
    ok = ok and same
    own = by_name[baseline_of(arm["arm"], baselines or {})]
    own_ratio = (arm["median_step_ms"] / own["median_step_ms"]
                 if arm["median_step_ms"] and own["median_step_ms"] else None)
    # Round r of the arm against round r of its baseline.
    round_ratios = [
        mine["median_step_ms"] / theirs["median_step_ms"]
        if mine["median_step_ms"] and theirs["median_step_ms"] else None
        for mine, theirs in zip(rounds_of(arm), rounds_of(own))]
    rows.append({"arm": arm["arm"], "median_step_ms": arm["median_step_ms"],
                 "ratio_vs_off": ratio, "baseline": own["arm"],
                 "ratio_vs_baseline": own_ratio,
                 "round_ratios_vs_baseline": (round_ratios if len(
                     round_ratios) > 1 else []),
                 "max_rel_loss_diff": max_diff,
                 "losses_match": same,
                 "final_loss": arm["losses"][-1] if arm["losses"] else None})
  return {"ok": ok, "rows": rows}


def _fmt(value, spec):
  return "-" if value is None else format(value, spec)


def markdown(result: dict) -> str:
  lines = [f"# A/B inside MaxText: {result['title']}", "",
           f"- machine: {result['machine']}",
           f"- versions: {result['versions']}",
           f"- command: `python scripts/maxtext_ab.py {result['argv']}`",
           f"- step time: median of MaxText's `perf/step_time_seconds` over "
           f"steps {WARMUP_STEPS}.. (steps 0..{WARMUP_STEPS - 1} compile)"
           + (f", pooled over {result['rounds']} rounds (arm order reversed "
              "every other round)" if result.get("rounds", 1) > 1 else ""),
           f"- losses match: relative difference per step <= "
           f"{LOSS_RTOL.get(result['dtype'], 2e-2)} ({result['dtype']})", "",
           *[f"**{line}**" for line in verdicts(result)], "",
           "| arm | median step (ms) | vs off | baseline | vs baseline | "
           "max rel. loss diff | final loss |",
           "|---|---|---|---|---|---|---|"]
  for row in result["comparison"]["rows"]:
    lines.append(
        f"| {row['arm']} | {_fmt(row['median_step_ms'], '.2f')} | "
        f"{_fmt(row['ratio_vs_off'], '.3f')} | {row.get('baseline', 'off')} "
        f"| {_fmt(row.get('ratio_vs_baseline'), '.3f')} | "
        f"{_fmt(row['max_rel_loss_diff'], '.2e')} | "
        f"{_fmt(row['final_loss'], '.5f')} |")
  per_round = [row for row in result["comparison"]["rows"]
               if row.get("round_ratios_vs_baseline")
               and row["arm"] != row["baseline"]]
  if per_round:
    lines.append("")
  for row in per_round:
    lines.append(
        f"- {row['arm']} / {row['baseline']}, round by round: " + ", ".join(
            _fmt(x, ".3f") for x in row["round_ratios_vs_baseline"]))
  profiled = [a for a in result["arms"] if a.get("profile")]
  if profiled:
    lines += ["", "GPU kernel time per step (ms, GPU 0, MaxText's xplane "
              "profile):", "",
              "| arm | busy | matmul | collective matmul | barrier | other "
              "compute | NCCL | NCCL not overlapped |",
              "|---|---|---|---|---|---|---|---|"]
    for a in profiled:
      p = a["profile"]
      if "error" in p:
        lines.append(f"| {a['arm']} | {p['error']} |||||||")
        continue
      c = p["class_ms"]
      lines.append(
          f"| {a['arm']} | {p['busy_ms']:.2f} | {c['matmul']:.2f} | "
          f"{c['collective_matmul']:.2f} | {c['barrier']:.2f} | "
          f"{c['compute']:.2f} | {c['nccl']:.2f} | "
          f"{p['nccl_exposed_ms']:.2f} |")
    for name, comparison in result.get("profile_comparisons", {}).items():
      lines += ["", f"- {name} against {comparison.get('baseline', 'off')}: "
                f"{comparison['sentence']}"]
  for arm in result["arms"]:
    if arm["rc"] != 0:
      lines += ["", f"**{arm['arm']} failed** (rc {arm['rc']}): see "
                f"{arm['arm']}.log"]
    if arm["decisions"]:
      lines += ["", f"Decisions, arm `{arm['arm']}`: "
                f"{arm['decision_summary']}", ""]
      lines += [f"- {d}" for d in arm["decisions"]]
  lines += ["", "Commands:", ""] + [
      f"- {a['arm']}: `{a['command']}`" + (
          f" with XLA_FLAGS=`{a['xla_flags']}`" if a["xla_flags"] else "")
      for a in result["arms"]]
  return "\n".join(lines) + "\n"


def on_cpu(result: dict) -> bool:
  """Whether the A/B ran on CPU devices (`result["machine"]`)."""
  return " x cpu," in result["machine"].lower()


def verdicts(result: dict) -> list[str]:
  """One line per arm against its baseline: do the losses match, which is
  faster and by how much; on CPU, what those step times do not measure."""
  ab_lib = _ab_lib()
  tolerance = LOSS_RTOL.get(result["dtype"], 2e-2)
  lines = []
  for row in result["comparison"]["rows"]:
    if row["arm"] == row["baseline"]:
      continue
    diff = row["max_rel_loss_diff"]
    losses = ("losses: no steps to compare" if diff is None else
              f"losses {'match' if row['losses_match'] else 'DO NOT match'}"
              f" (max relative difference {diff:.2e}, tolerance "
              f"{tolerance:.0e})")
    lines.append(f"{row['arm']} vs {row['baseline']}: {losses}; "
                 + ab_lib.speed_verdict(row["ratio_vs_baseline"], row["arm"],
                                        row["baseline"])
                 + " (median step time)")
  if on_cpu(result):
    lines.append(ab_lib.CPU_STEP_TIME_CAVEAT)
  return lines


def figure(result: dict):
  """Step times, losses and each arm's loss minus its baseline's per step
  (and with rounds, each round's median); matplotlib's Figure."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  rounds = result.get("rounds", 1) > 1
  fig, axes = plt.subplots(1, 4 if rounds else 3,
                           figsize=(20 if rounds else 15, 4.6))
  ax_t, ax_l, ax_d = axes[0], axes[1], axes[2]
  if rounds:  # Each round's median per arm: the drift the rounds average.
    for arm in result["arms"]:
      medians = [r["median_step_ms"] for r in arm.get("rounds", [])]
      axes[3].plot(range(1, len(medians) + 1), medians, marker="o",
                   label=arm["arm"])
    axes[3].set_xticks(range(1, result["rounds"] + 1))
    axes[3].set(xlabel="round", ylabel="median step time (ms)",
                title="each round's median (order reversed every other)")
    axes[3].legend()
  by_name = {a["arm"]: a for a in result["arms"]}
  baselines = result.get("baselines", {})
  for arm in result["arms"]:
    times = [1e3 * t for t in arm["step_times_s"]][WARMUP_STEPS:]
    ax_t.plot(range(WARMUP_STEPS, WARMUP_STEPS + len(times)), times,
              marker=".", label=f"{arm['arm']} ("
              + ("pooled " if rounds else "")
              + f"median {_fmt(arm['median_step_ms'], '.1f')} ms)")
    ax_l.plot(range(len(arm["losses"])), arm["losses"], marker=".",
              label=arm["arm"])
    base = by_name[baseline_of(arm["arm"], baselines)]
    if base is not arm:
      n = min(len(arm["losses"]), len(base["losses"]))
      ax_d.plot(range(n), [arm["losses"][i] - base["losses"][i]
                           for i in range(n)], marker=".",
                label=f"{arm['arm']} - {base['arm']}")
  ax_d.axhline(0.0, color="gray", linewidth=0.8)
  ax_t.set(xlabel="step", ylabel="step time (ms)",
           title="MaxText step time per arm" + (" (round 1)" if rounds
                                               else ""))
  ax_l.set(xlabel="step", ylabel="loss", title="loss per arm")
  ax_d.set(xlabel="step", ylabel="loss difference",
           title="loss minus the baseline's")
  for ax in (ax_t, ax_l, ax_d):
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    if ax.get_legend_handles_labels()[0]:
      ax.legend()
  lines = [result["title"]] if result["title"] else []
  lines += [line for line in verdicts(result)
            if line != _ab_lib().CPU_STEP_TIME_CAVEAT]
  if on_cpu(result):
    lines.append("CPU: step times do not measure the GPU overlap; GPU "
                 "figures: benchmarks/RESULTS.md")
  fig.suptitle("\n".join(lines), fontsize=9)
  fig.tight_layout()
  return fig


def plot(result: dict, path: str) -> bool:
  """Writes `figure(result)` to `path`; False, saying why, without
  matplotlib."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print(f"no {path}: matplotlib is not installed (pip install matplotlib; "
          "the maxtext and plot extras include it)", flush=True)
    return False
  fig = figure(result)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """The docstring as written, and each option's default where it has
  one."""

  def _get_help_string(self, action):
    help_text = action.help or ""
    if action.default not in (None, "", [], argparse.SUPPRESS) and (
        action.option_strings):
      help_text += " (default: %(default)s)"
    return help_text


def build_parser() -> argparse.ArgumentParser:
  """The command line (README's commands are parsed with it)."""
  parser = argparse.ArgumentParser(
      description=__doc__, epilog=arms_help(), formatter_class=_HelpFormatter)
  parser.add_argument("--out", required=True,
                      help="directory for ab.json, report.md, ab.png and "
                      "each arm's log and metrics")
  parser.add_argument("--arms", default="off,auto,windowed",
                      help="comma-separated named arms (listed below); "
                      "'off' is required")
  parser.add_argument("--arm", action="append", default=[],
                      metavar="NAME=ARGS",
                      help="an extra arm, repeatable: ARGS' --xla_* flags go "
                      "to XLA_FLAGS, its other -- flags to the launcher (the "
                      "plugin's flags) and its key=value arguments to "
                      "MaxText, e.g. 'auto_noscan=--use_collective_matmul "
                      "scan_layers=False'")
  parser.add_argument("--timeout", type=int, default=300,
                      help="seconds per arm")
  parser.add_argument("--title", default="",
                      help="title of report.md and ab.png")
  parser.add_argument("--profile_steps", type=int, default=0,
                      help="profile this many steps per arm (MaxText's "
                      "profiler=xplane, after the warm-up) and report where "
                      "each arm's GPU time goes; they are left out of the "
                      "median")
  parser.add_argument("--compare", action="append", default=[],
                      metavar="ARM=BASELINE",
                      help="compare ARM with BASELINE instead of off (step "
                      "ratio and profile), e.g. auto_attn=attn")
  parser.add_argument("--rounds", type=int, default=1,
                      help="run every arm this many times, the order "
                      "reversed every other round; step times are pooled "
                      "(only the first round is profiled)")
  parser.add_argument("maxtext_args", nargs=argparse.REMAINDER,
                      help="after --: MaxText's config file and key=value "
                      "arguments, the same for every arm")
  return parser


def main() -> int:
  parser = build_parser()
  args = parser.parse_args()
  maxtext_args = [a for a in args.maxtext_args if a != "--"]
  arms = args.arms.split(",") + args.arm
  try:
    names = [parse_arm(a)[0] for a in arms]
  except ValueError as e:
    parser.error(str(e))
  if "off" not in names or len(set(names)) != len(names):
    parser.error(f"the arms need 'off' and distinct names, got {names}")
  baselines = {}
  for pair in args.compare:
    arm, _, base = pair.partition("=")
    if arm not in names or base not in names or arm == base:
      parser.error(f"--compare {pair!r}: ARM=BASELINE, two different arms "
                   f"of {names}")
    baselines[arm] = base
  if args.profile_steps < 0:
    parser.error(f"--profile_steps={args.profile_steps} must be >= 0")
  if args.rounds < 1:
    parser.error(f"--rounds={args.rounds} must be >= 1")
  if args.timeout <= 0:
    parser.error(f"--timeout={args.timeout} must be > 0 (seconds per arm)")
  if not maxtext_args or not maxtext_args[0].endswith(".yml"):
    parser.error("give MaxText's base.yml and key=value arguments after --")
  # Before the first arm: the results' directory is writable.
  checkpoint = _checkpoint_lib()
  try:
    checkpoint.check_writable_directory(args.out, "--out directory")
  except checkpoint.StorageError as e:
    parser.error(str(e))
  dtype = next((a.split("=", 1)[1] for a in maxtext_args
                if a.startswith("dtype=")), "bfloat16")
  runs = {name: [] for name in names}
  for number, order in enumerate(round_orders(arms, args.rounds)):
    tag = f"_r{number}" if args.rounds > 1 else ""
    for arm in order:
      print(f"== arm {arm}"
            + (f", round {number + 1} of {args.rounds}" if tag else "")
            + " ...", flush=True)
      r = run_arm(arm, maxtext_args, args.out, args.timeout,
                  args.profile_steps if number == 0 else 0, tag=tag)
      runs[r["arm"]].append(r)
      print(f"   rc={r['rc']} {r['seconds']} s, median step "
            f"{_fmt(r['median_step_ms'], '.2f')} ms, {len(r['losses'])} steps"
            + (f", {r['decision_summary']}" if r["decision_summary"] else ""),
            flush=True)
  results = [merge_rounds(runs[name]) for name in names]
  import jax  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  result = {
      "title": args.title or " ".join(a for a in maxtext_args[1:]
                                      if a.startswith(("model_name=",
                                                       "ici_"))),
      "argv": " ".join(sys.argv[1:]), "dtype": dtype,
      "rounds": args.rounds,
      "machine": f"{len(devices)} x {devices[0].device_kind}, "
                 f"{platform.node()}",
      "versions": f"python {platform.python_version()}, jax "
                  f"{jax.__version__}, maxtext "
                  f"{_version('maxtext')}, flax {_version('flax')}",
      "arms": results, "baselines": baselines,
      "comparison": compare(results, dtype, baselines),
      "profile_comparisons": (profile_comparisons(results, baselines)
                              if args.profile_steps else {})}
  with open(os.path.join(args.out, "ab.json"), "w") as f:
    json.dump(result, f, indent=1)
  plotted = plot(result, os.path.join(args.out, "ab.png"))
  report = markdown(result) + ("\n![step times and losses](ab.png)\n"
                               if plotted else "")
  with open(os.path.join(args.out, "report.md"), "w") as f:
    f.write(report)
  print(report)
  for line in verdicts(result):
    print(line)
  print(f"written: {os.path.join(args.out, 'report.md')}, ab.json"
        + (", ab.png" if plotted else ""))
  return 0 if result["comparison"]["ok"] else 1


def _version(package: str) -> str:
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


if __name__ == "__main__":
  sys.exit(main())
