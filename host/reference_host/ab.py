"""A/B harness: baseline (plugin off) against collective matmul (plugin on).

Both arms start from the same initial parameters (one init, copied) and see
the same batches; their steps are interleaved (A, B, A, B, ...) so slow drift
of the machine (clocks, other load) hits both alike.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
from typing import Callable

import jax

import collective_matmul as cm

from reference_host import config as config_lib
from reference_host import profile as profile_lib
from reference_host import trainer as trainer_lib

# Largest per-step |loss difference| / |baseline loss| that still counts as
# the same training run: float32 differs only by summation order; 16-bit
# types round each partial product.
DEFAULT_RELATIVE_LOSS_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2,
                                   "float16": 1e-2}
# Said by every report and plot of an A/B run on CPU devices.
CPU_STEP_TIME_CAVEAT = (
    "CPU devices: step times here do not measure the GPU overlap (the ring "
    "is a sequence of ppermutes between emulated devices sharing the host's "
    "cores, so the collective arm is usually slower); GPU figures are in "
    "benchmarks/RESULTS.md")


def speed_verdict(ratio: float | None, arm: str = "collective",
                  baseline: str = "baseline") -> str:
  """'collective is 4.3 % faster than baseline' from arm / baseline median
  step time (< 1: the arm is faster)."""
  if ratio is None:
    return f"{arm} vs {baseline}: no step time to compare"
  if abs(ratio - 1) < 5e-4:
    return f"{arm} and {baseline} take the same time per step"
  if ratio < 1:
    return f"{arm} is {100 * (1 - ratio):.1f} % faster than {baseline}"
  return f"{arm} is {100 * (ratio - 1):.1f} % slower than {baseline}"


def on_cpu(device_kind: str) -> bool:
  """Whether a device kind (jax's `device_kind`) is a CPU."""
  return "cpu" in device_kind.lower()


@dataclasses.dataclass
class ABResult:
  config: config_lib.Config
  collective_config: cm.CollectiveMatmulConfig
  baseline: list[trainer_lib.StepRecord]
  collective: list[trainer_lib.StepRecord]
  decisions: list  # cm.Decision from tracing the collective arm's step
  baseline_compile_s: float
  collective_compile_s: float
  relative_tolerance: float
  mesh_shape: dict[str, int]
  device_kind: str
  # XLA options the baseline arm was compiled with ({}: XLA's defaults).
  baseline_compiler_options: dict = dataclasses.field(default_factory=dict)
  # With profiling: {"baseline"/"collective": profile.Breakdown,
  # "comparison": profile.Comparison, "collectives": {arm: [...]},
  # "traces": {arm: path}}.
  profile: dict | None = None

  @property
  def loss_diffs(self) -> list[float]:
    return [c.loss - b.loss for b, c in zip(self.baseline, self.collective)]

  @property
  def max_relative_loss_diff(self) -> float:
    return max(abs(d) / max(abs(b.loss), 1e-12)
               for d, b in zip(self.loss_diffs, self.baseline))

  @property
  def losses_match(self) -> bool:
    return self.max_relative_loss_diff <= self.relative_tolerance

  @property
  def baseline_times(self) -> dict[str, float]:
    return trainer_lib.summarize_step_times(
        [r.step_time_s for r in self.baseline])

  @property
  def collective_times(self) -> dict[str, float]:
    return trainer_lib.summarize_step_times(
        [r.step_time_s for r in self.collective])

  @property
  def step_time_ratio(self) -> float:
    """Collective median step time / baseline median (< 1: faster)."""
    return self.collective_times["median_s"] / self.baseline_times["median_s"]

  @property
  def speed_verdict(self) -> str:
    return speed_verdict(self.step_time_ratio,
                         f"collective ({self.collective_config.impl})")

  @property
  def rewritten_layers(self) -> list[str]:
    return sorted({d.name or "dot_general" for d in self.decisions
                   if d.rewritten})


def check_relative_tolerance(tolerance: float | None) -> None:
  """Raises ValueError unless `tolerance` (a largest relative loss
  difference; None for the dtype's default) is finite and >= 0: a negative
  one fails equal losses and a NaN fails every comparison."""
  if tolerance is not None and not (math.isfinite(tolerance)
                                    and tolerance >= 0):
    raise ValueError(f"relative loss tolerance {tolerance} is not a finite "
                     "number >= 0")


def run_ab(config: config_lib.Config,
           collective_config: cm.CollectiveMatmulConfig,
           num_steps: int | None = None, *, devices=None,
           relative_tolerance: float | None = None,
           log: Callable[[str], None] | None = print,
           profile_steps: int = 0,
           profile_dir: str | None = None,
           baseline_compiler_options: dict | None = None) -> ABResult:
  """Trains both arms for `num_steps` (default: config.steps) steps.

  With `profile_steps`, each arm then runs that many more steps under the
  JAX profiler (traces under `profile_dir/<arm>/`), and the result carries
  each arm's GPU time breakdown and their comparison (`profile.py`).
  `baseline_compiler_options` compiles the baseline arm with these XLA
  options, e.g. `trainer.WINDOWED_EINSUM` for XLA's own overlap.
  """
  check_relative_tolerance(relative_tolerance)
  collective_config = dataclasses.replace(collective_config, enabled=True)
  baseline_config = dataclasses.replace(collective_config, enabled=False)
  baseline = trainer_lib.Trainer(config, baseline_config, devices=devices,
                                 compiler_options=baseline_compiler_options)
  collective = trainer_lib.Trainer(config, collective_config, devices=devices)
  baseline.compile()
  collective.compile()
  if log:
    log(f"compiled: baseline {baseline.compile_time_s:.1f} s, collective "
        f"{collective.compile_time_s:.1f} s")
    log(cm.format_decisions(collective.decisions))

  baseline_state = baseline.init_state()
  # The parameter tree does not depend on the flag, so one init serves both.
  collective_state = jax.tree.map(lambda x: x.copy(), baseline_state)
  steps = baseline.config.steps if num_steps is None else num_steps
  baseline_records, collective_records = [], []
  for step in range(steps):
    baseline_state, b = baseline.run_step(baseline_state, step)
    collective_state, c = collective.run_step(collective_state, step)
    baseline_records.append(b)
    collective_records.append(c)
    if log and (step % baseline.config.log_period == 0 or step == steps - 1):
      log(f"step {step:5d} | loss baseline {b.loss:.6f} collective "
          f"{c.loss:.6f} (diff {c.loss - b.loss:+.2e}) | step time "
          f"{1e3 * b.step_time_s:.1f} / {1e3 * c.step_time_s:.1f} ms")
  profile = None
  if profile_steps:
    if profile_dir is None:
      raise ValueError("profile_steps needs a profile_dir")
    profile = _profile_arms(
        {"baseline": (baseline, baseline_state),
         "collective": (collective, collective_state)},
        first_step=steps, num_steps=profile_steps, profile_dir=profile_dir,
        log=log)
  if relative_tolerance is None:
    relative_tolerance = DEFAULT_RELATIVE_LOSS_TOLERANCE[config.dtype]
  return ABResult(
      config=baseline.config, collective_config=collective_config,
      baseline=baseline_records, collective=collective_records,
      decisions=collective.decisions,
      baseline_compile_s=baseline.compile_time_s,
      collective_compile_s=collective.compile_time_s,
      relative_tolerance=relative_tolerance,
      mesh_shape=dict(baseline.mesh.shape),
      device_kind=baseline.mesh.devices.flat[0].device_kind,
      profile=profile,
      baseline_compiler_options=dict(baseline_compiler_options or {}))


def _profile_arms(arms: dict, *, first_step: int, num_steps: int,
                  profile_dir: str, log) -> dict:
  """Profiles `num_steps` steps of each arm (after its timed steps)."""
  out = {"traces": {}, "collectives": {}}
  for name, (trainer, state) in arms.items():
    def run_steps(trainer=trainer, state=state):
      for step in range(first_step, first_step + num_steps):
        state, _ = trainer.run_step(state, step)
      jax.block_until_ready(state)
    trace = profile_lib.record(run_steps, os.path.join(profile_dir, name))
    out["traces"][name] = trace
    out[name] = profile_lib.breakdown(profile_lib.load_events(trace),
                                      steps=num_steps)
    out["collectives"][name] = profile_lib.collectives_in_hlo(
        trainer.compile().as_text())
    if log:
      log("\n".join(profile_lib.format_breakdown(name, out[name])))
  out["comparison"] = profile_lib.compare(out["baseline"], out["collective"])
  if log:
    log(out["comparison"].sentence())
  return out


def parse_xla_options(items: list[str]) -> dict:
  """{"name": value} from "name=value" strings: true/false become bools,
  integers and floats numbers, anything else stays a string."""
  options = {}
  for item in items:
    name, sep, text = item.partition("=")
    if not sep or not name.startswith("xla_"):
      raise ValueError(f"{item!r} is not NAME=VALUE with an xla_ option name")
    if text.lower() in ("true", "false"):
      value = text.lower() == "true"
    else:
      try:
        value = int(text)
      except ValueError:
        try:
          value = float(text)
        except ValueError:
          value = text
    options[name] = value
  return options


def check_xla_options(options: dict) -> None:
  """Compiles a one-op program with `options`, so an option XLA does not
  know, or a value it cannot take, is reported (ValueError, one line naming
  it) before either arm is built or trained."""
  if not options:
    return
  lowered = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), "float32"))
  try:
    lowered.compile(compiler_options=dict(options))
  except jax.errors.JaxRuntimeError as e:
    message = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    raise ValueError(f"XLA refuses {options}: "
                     f"{message.removeprefix('INVALID_ARGUMENT: ')}") from None


def _sharding_axes(mesh_shape: dict[str, int]) -> dict[str, int]:
  """The mesh axes of more than one device: of MaxText's many axes, the
  ones that shard anything (all of them when none does)."""
  return {axis: size for axis, size in mesh_shape.items() if size > 1} or (
      mesh_shape)


def default_tag(result: ABResult) -> str:
  mesh = "x".join(f"{axis}{size}" for axis, size in
                  _sharding_axes(result.mesh_shape).items())
  platform_name = result.device_kind.replace(" ", "-").lower()
  vs = "-vs-xla-options" if result.baseline_compiler_options else ""
  return (f"{result.config.model_name}-{platform_name}-{mesh}-"
          f"{result.collective_config.impl}{vs}")


def _summary_lines(result: ABResult) -> list[str]:
  b, c = result.baseline_times, result.collective_times
  verdict = "match" if result.losses_match else "DO NOT match"
  return [
      f"losses {verdict}: max |diff| / |baseline| = "
      f"{result.max_relative_loss_diff:.2e} (tolerance "
      f"{result.relative_tolerance:.0e}, {len(result.baseline)} steps)",
      f"step time median baseline {1e3 * b['median_s']:.2f} ms "
      f"(min {1e3 * b['min_s']:.2f}, max {1e3 * b['max_s']:.2f}, stdev "
      f"{1e3 * b['stdev_s']:.2f}); collective {1e3 * c['median_s']:.2f} ms "
      f"(min {1e3 * c['min_s']:.2f}, max {1e3 * c['max_s']:.2f}, stdev "
      f"{1e3 * c['stdev_s']:.2f}); ratio collective/baseline "
      f"{result.step_time_ratio:.3f} (first step left out): "
      f"{result.speed_verdict}",
  ] + ([CPU_STEP_TIME_CAVEAT] if on_cpu(result.device_kind) else []) + (
      [result.profile["comparison"].sentence()] if result.profile else [])


def summary(result: ABResult) -> str:
  return "\n".join(_summary_lines(result))


def to_json(result: ABResult, command: str | None) -> dict:
  return {
      "command": command,
      "device_kind": result.device_kind,
      "mesh_shape": result.mesh_shape,
      "jax_version": jax.__version__,
      "host": platform.node(),
      "collective_config": dataclasses.asdict(result.collective_config),
      "config": {k: v for k, v in result.config.to_dict().items()},
      "baseline": [dataclasses.asdict(r) for r in result.baseline],
      "collective": [dataclasses.asdict(r) for r in result.collective],
      "baseline_compile_s": result.baseline_compile_s,
      "collective_compile_s": result.collective_compile_s,
      "step_time_ratio": result.step_time_ratio,
      "speed_verdict": result.speed_verdict,
      "step_time_caveat": (CPU_STEP_TIME_CAVEAT
                            if on_cpu(result.device_kind) else None),
      "baseline_step_times": result.baseline_times,
      "collective_step_times": result.collective_times,
      "max_relative_loss_diff": result.max_relative_loss_diff,
      "relative_tolerance": result.relative_tolerance,
      "losses_match": result.losses_match,
      "baseline_compiler_options": result.baseline_compiler_options,
      "profile": _profile_json(result.profile),
      "decisions": [
          {"name": d.name, "rewritten": d.rewritten, "impl": d.impl,
           "reason": d.reason, "lhs_shape": list(d.lhs_shape),
           "rhs_shape": list(d.rhs_shape), "dtype": str(d.dtype),
           "axis": d.axis} for d in result.decisions],
  }


def _profile_json(profile: dict | None) -> dict | None:
  if not profile:
    return None
  return {"baseline": profile["baseline"].to_json(),
          "collective": profile["collective"].to_json(),
          "comparison": profile["comparison"].to_json(),
          "collectives": profile["collectives"],
          "traces": profile["traces"]}


def _profile_markdown(profile: dict) -> list[str]:
  b, c = profile["baseline"], profile["collective"]
  rows = [("busy", b.busy_ms, c.busy_ms)] + [
      (label, b.class_ms[cls], c.class_ms[cls]) for cls, label in (
          ("matmul", "matmul (cuBLAS/XLA)"),
          ("collective_matmul", "collective matmul kernels"),
          ("barrier", "pre-kernel barrier"),
          ("compute", "other compute"), ("memcpy", "memcpy/memset"),
          ("nccl", "NCCL"))] + [
      ("NCCL not overlapped by compute", b.nccl_exposed_ms,
       c.nccl_exposed_ms)]
  lines = [
      "## Where the GPU time goes",
      "",
      f"Kernel time per step on {b.device}, {b.steps} profiled steps per arm "
      "(JAX profiler; traces: "
      + ", ".join(f"`{p}`" for p in profile["traces"].values()) + ").",
      "",
      "| ms per step | baseline | collective | difference |",
      "|---|---:|---:|---:|",
      *[f"| {label} | {bv:.2f} | {cv:.2f} | {cv - bv:+.2f} |"
        for label, bv, cv in rows],
      "",
      profile["comparison"].sentence(),
      *_projection_markdown(b, c),
      "",
      "Collectives the collective arm still runs (compiled HLO, per device):",
      "",
  ]
  ops = {o["op"]: o for o in c.nccl_ops}
  left = profile["collectives"]["collective"]
  if not left:
    lines.append("- none")
  for item in left:
    lines.append(f"- `{item['name']}` {item['op']} {item['shape']} "
                 f"({item['bytes'] / 2**20:.1f} MiB)")
  if ops:
    lines += ["", "NCCL kernels in the collective arm's trace (per step):",
              ""]
    lines += [f"- `{o['op']}` ({o['scope'] or 'no scope'}): "
              f"{o['ms_per_step']:.3f} ms, {o['exposed_ms_per_step']:.3f} "
              f"of it not overlapped, {o['count_per_step']:g} launches"
              for o in c.nccl_ops if o["ms_per_step"] >= 0.01]
  return lines + [""]


def _grouped_like(baseline: dict, collective: dict) -> dict:
  """The baseline's per-projection times with the members of each group the
  collective arm ran as one kernel ("query+key+value forward") summed into
  that group's row, so the rows compare like with like."""
  out = dict(baseline)
  for group in collective:
    names, direction = group.rsplit(" ", 1)
    if "+" not in names:
      continue
    summed: dict[str, float] = {}
    for member in names.split("+"):
      for cls, ms in out.pop(f"{member} {direction}", {}).items():
        summed[cls] = summed.get(cls, 0.0) + ms
    out[group] = summed
  return out


def _projection_markdown(b, c) -> list[str]:
  """Per projection and pass: what the baseline spends (GEMMs + NCCL)
  against the collective arm (its kernels, barriers, remaining GEMMs and
  NCCL), from the ops' name scopes."""
  baseline = _grouped_like(b.projections, c.projections)
  names = sorted(set(baseline) | set(c.projections))
  if not names:
    return []
  lines = ["", "Per projection (ms per step, from each op's name scope; a "
           "GEMM XLA fused under another name is not counted):", "",
           "| projection | baseline GEMM | baseline NCCL | collective kernels "
           "+ barriers | collective GEMM | collective NCCL | difference |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for name in names:
    bp, cp = baseline.get(name, {}), c.projections.get(name, {})
    base = bp.get("matmul", 0.0) + bp.get("nccl", 0.0)
    kernels = cp.get("collective_matmul", 0.0) + cp.get("barrier", 0.0)
    coll = kernels + cp.get("matmul", 0.0) + cp.get("nccl", 0.0)
    lines.append(
        f"| {name} | {bp.get('matmul', 0.0):.3f} | {bp.get('nccl', 0.0):.3f}"
        f" | {kernels:.3f} | {cp.get('matmul', 0.0):.3f} | "
        f"{cp.get('nccl', 0.0):.3f} | {coll - base:+.3f} |")
  return lines + [""]


def _markdown(result: ABResult, command: str | None, png_name: str | None
              ) -> str:
  cfg = result.config
  lines = [
      f"# A/B: collective matmul ({result.collective_config.impl}) vs baseline",
      "",
  ]
  if command:
    lines += ["Command:", "", "```", command, "```", ""]
  lines += [
      f"- devices: {result.device_kind}, mesh "
      + ", ".join(f"{k}={v}" for k, v in
                  _sharding_axes(result.mesh_shape).items())
      + " (other axes 1)",
      f"- model: {cfg.model_name} (emb {cfg.emb_dim}, mlp {cfg.mlp_dim}, "
      f"heads {cfg.num_query_heads}/{cfg.num_kv_heads}, layers "
      f"{cfg.num_decoder_layers}, vocab {cfg.vocab_size}), dtype {cfg.dtype}",
      f"- global batch {cfg.global_batch_size} x {cfg.max_target_length} "
      f"tokens, {len(result.baseline)} steps, jax {jax.__version__}",
      f"- compile: baseline {result.baseline_compile_s:.1f} s, collective "
      f"{result.collective_compile_s:.1f} s",
      "- baseline: plugin off, XLA "
      + (f"with {result.baseline_compiler_options}"
         if result.baseline_compiler_options else "defaults"),
      "",
      "## Summary",
      "",
      *[f"- {line}" for line in _summary_lines(result)],
      "",
      "## Layers",
      "",
      "```",
      cm.format_decisions(result.decisions),
      "```",
      "",
  ]
  if png_name:
    lines += [f"![loss and step time]({png_name})", ""]
  if result.profile:
    lines += _profile_markdown(result.profile)
  lines += [
      "## Per step",
      "",
      "| step | loss baseline | loss collective | diff | step time baseline (ms) "
      "| step time collective (ms) |",
      "|---:|---:|---:|---:|---:|---:|",
  ]
  for b, c in zip(result.baseline, result.collective):
    lines.append(f"| {b.step} | {b.loss:.6f} | {c.loss:.6f} | "
                 f"{c.loss - b.loss:+.2e} | {1e3 * b.step_time_s:.2f} | "
                 f"{1e3 * c.step_time_s:.2f} |")
  return "\n".join(lines) + "\n"


def plot_title(result: ABResult) -> str:
  """The plot's title: which arm is faster and by how much, whether the
  losses match, and on CPU that its step times say nothing of the GPU."""
  verdict = "losses match" if result.losses_match else "losses DO NOT match"
  title = (f"{result.config.model_name} on {result.device_kind}: "
           f"{result.speed_verdict} (median step time); {verdict}")
  if on_cpu(result.device_kind):
    title += ("\nCPU: step times do not measure the GPU overlap; GPU "
              "figures: benchmarks/RESULTS.md")
  return title


def figure(result: ABResult):
  """Loss curves overlaid, the collective arm's loss minus the baseline's,
  and the step-time distributions (matplotlib's Figure)."""
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  steps = [r.step for r in result.baseline]
  fig, (loss_ax, diff_ax, time_ax) = plt.subplots(1, 3, figsize=(15, 4.4))
  collective_label = f"collective ({result.collective_config.impl})"
  loss_ax.plot(steps, [r.loss for r in result.baseline], "o-",
               label="baseline", alpha=0.8)
  loss_ax.plot(steps, [r.loss for r in result.collective], "x--",
               label=collective_label, alpha=0.8)
  loss_ax.set(xlabel="step", ylabel="loss", title="loss")
  loss_ax.legend()
  diff_ax.plot(steps, result.loss_diffs, "o-", color="C2")
  diff_ax.axhline(0.0, color="gray", linewidth=0.8)
  diff_ax.set(xlabel="step", ylabel="loss difference",
              title=f"{collective_label} - baseline (max relative "
                    f"{result.max_relative_loss_diff:.1e}, tolerance "
                    f"{result.relative_tolerance:.0e})")
  for ax in (loss_ax, diff_ax):
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  # The first step is left out of the distributions: it warms caches.
  steady = slice(1, None) if len(steps) > 2 else slice(None)
  time_ax.boxplot(
      [[1e3 * r.step_time_s for r in result.baseline[steady]],
       [1e3 * r.step_time_s for r in result.collective[steady]]],
      tick_labels=["baseline", collective_label])
  time_ax.set(ylabel="step time (ms)",
              title=f"step time: collective / baseline "
                    f"{result.step_time_ratio:.3f}")
  fig.suptitle(plot_title(result))
  fig.tight_layout()
  return fig


def _plot(result: ABResult, path: str) -> bool:
  """Writes `figure(result)` to `path`; False without matplotlib (an
  optional dependency: the `plot` extra), saying so."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    logging.warning("matplotlib is not installed: no PNG written to %s "
                    "(pip install matplotlib, or the plot extra)", path)
    return False
  fig = figure(result)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def write_report(result: ABResult, output_dir: str,
                 command: str | None = None) -> dict[str, str]:
  """Writes report.md, ab.json and (with matplotlib) ab.png; returns paths."""
  os.makedirs(output_dir, exist_ok=True)
  paths = {"report": os.path.join(output_dir, "report.md"),
           "json": os.path.join(output_dir, "ab.json")}
  png_path = os.path.join(output_dir, "ab.png")
  if _plot(result, png_path):
    paths["png"] = png_path
  with open(paths["report"], "w") as f:
    f.write(_markdown(result, command, "ab.png" if "png" in paths else None))
  with open(paths["json"], "w") as f:
    json.dump(to_json(result, command), f, indent=1, default=str)
  return paths
