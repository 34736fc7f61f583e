"""Reads a warpgroup trace of our kernels: where each block's time goes.

`collective_matmul.kernels.trace_warpgroups(dir)` makes every traced kernel
call write Mosaic GPU's on-device profile, a Chrome trace with one track per
block and warpgroup, holding the skeleton's phases (`tracing.PHASES`): each
tile's k loop (`mma`) and epilogue on the two compute warpgroups, and the
collectives' waits. This script turns one such trace into figures:

  per tile    median cycles of `mma`, `epilogue` and the `gap` from the end
              of a tile's epilogue to the start of the next tile's k loop,
              over all tiles and by a block's tile index (its 1st, 2nd, ...)
  per block   the span from its first event to its last, and what share of
              it each phase takes (on compute warpgroup 0)
  tail        how far apart the blocks finish (from the blocks' global start
              times, in ns, plus their spans at `--sm-clock-mhz`)

Times inside a block are SM clock cycles (`%clock`); the profiler's own
cost per event (about 12 cycles) is already taken out by JAX.

  python tools/warpgroup_trace.py TRACE.json [--plot timeline.png]
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import statistics
import tempfile

# Warpgroups per block in our kernels: 2 compute, then the memory one.
WARPGROUPS = 3


def load(path):
  """The trace's tracks: [{"block", "wg", "sm", "start_ns", "ranges":
  [(name, begin_cycles, end_cycles), ...]}], ranges in order of their end.
  Nested ranges are kept (a wait inside an epilogue)."""
  with open(path) as f:
    events = json.load(f)["traceEvents"]
  by_tid = collections.defaultdict(list)
  for e in events:
    by_tid[e["tid"]].append(e)
  tracks = []
  for tid, evs in sorted(by_tid.items()):
    first_ns = evs[0]["ts"] * 1e3  # The block's start (ns) at cycle 0.
    stack, ranges = [], []
    for e in evs:
      cycles = e["ts"] * 1e3 - first_ns
      if e["ph"] == "B":
        stack.append((e["name"], cycles))
      else:
        name, begin = stack.pop()
        if name != e["name"]:
          raise ValueError(f"track {tid}: {e['name']!r} ends inside "
                           f"{name!r}")
        ranges.append((name, begin, cycles))
    block, wg = divmod(tid - 1, WARPGROUPS)
    tracks.append({"block": block, "wg": wg, "sm": evs[0]["pid"] - 1,
                   "start_ns": first_ns, "ranges": ranges})
  return tracks


def _median(values):
  return statistics.median(values) if values else None


def tile_phases(track):
  """Per tile of a compute track: (mma, epilogue, gap before the mma) in
  cycles, from its `mma` and `epilogue` ranges in order."""
  mmas = [r for r in track["ranges"] if r[0] == "mma"]
  epis = [r for r in track["ranges"] if r[0] == "epilogue"]
  tiles = []
  prev_end = None
  for (_, mb, me), (_, eb, ee) in zip(mmas, epis):
    tiles.append((me - mb, ee - eb, None if prev_end is None else mb - prev_end))
    prev_end = ee
  return tiles


def summarize(tracks, sm_clock_mhz: float | None = None):
  """Figures of a trace (`load`), as a dict (see the module docstring)."""
  compute = [t for t in tracks if t["wg"] == 0 and t["ranges"]]
  if not compute:
    raise ValueError("no compute warpgroup recorded a range: was the kernel "
                     "traced inside trace_warpgroups?")
  mma, epi, gap = [], [], []
  names = collections.Counter()
  spans, shares = [], collections.defaultdict(list)
  for t in compute:
    for m, e, g in tile_phases(t):
      mma.append(m)
      epi.append(e)
      if g is not None:
        gap.append(g)
    begin = min(r[1] for r in t["ranges"])
    end = max(r[2] for r in t["ranges"])
    span = end - begin
    spans.append(span)
    totals = collections.Counter()
    for name, b, e in t["ranges"]:
      names[name] += 1
      totals[name] += e - b
    for name, total in totals.items():
      shares[name].append(total / span if span else 0.0)
  # By a block's tile index (its 1st, 2nd, ... tile): where a ring's
  # steps or a stall fall (e.g. step 0's tiles come first in a block).
  by_index = collections.defaultdict(list)
  for t in compute:
    for i, phases in enumerate(tile_phases(t)):
      by_index[i].append(phases)
  per_index = [
      {"index": i, "blocks": len(v),
       "mma": _median([m for m, _, _ in v]),
       "epilogue": _median([e for _, e, _ in v]),
       "gap": _median([g for _, _, g in v if g is not None])}
      for i, v in sorted(by_index.items())]
  out = {
      "blocks": len(compute),
      "tiles": len(mma),
      "ranges": dict(names),
      "median_cycles": {"mma": _median(mma), "epilogue": _median(epi),
                        "gap": _median(gap)},
      "max_cycles": {"mma": max(mma, default=None),
                     "epilogue": max(epi, default=None),
                     "gap": max(gap, default=None)},
      "median_share_of_span": {n: _median(v) for n, v in shares.items()},
      "block_span_cycles": {"median": _median(spans), "min": min(spans),
                            "max": max(spans)},
      "per_tile_index": per_index,
  }
  if sm_clock_mhz:
    ends = [t["start_ns"] + (max(r[2] for r in t["ranges"]) * 1e3 /
                             sm_clock_mhz) for t in compute]
    starts = [t["start_ns"] for t in compute]
    out["sm_clock_mhz"] = sm_clock_mhz
    out["tail_ns"] = {"first_block_end": min(ends) - min(starts),
                      "last_block_end": max(ends) - min(starts),
                      "last_block_start": max(starts) - min(starts)}
  return out


def one_line(summary):
  """A summary (`summarize`, `run_traced`) in one line."""
  med = summary["median_cycles"]
  text = (f"trace: mma {med['mma']:.0f}, epilogue {med['epilogue']:.0f}, "
          f"gap {med['gap'] or 0:.0f} cycles per tile; block span median "
          f"{summary['block_span_cycles']['median']:.0f}, max "
          f"{summary['block_span_cycles']['max']:.0f}")
  waits = {n: v for n, v in summary["median_share_of_span"].items()
           if n.startswith("wait")}
  if waits:
    text += "; " + ", ".join(f"{n} {v:.1%} of a span" for n, v in
                             waits.items())
  if "traced_us" in summary:
    text += f"; traced {summary['traced_us']:.1f} us"
  return text


def run_traced(build, operands, ranges: int, dest: str, mesh=None,
               timing_iterations: int = 3, warmup_calls: int = 1):
  """Jits `build()` inside `kernels.trace_warpgroups(tmp, ranges)` (under
  `mesh`), runs it `warmup_calls` times (their traces dropped), then once
  more, copies that call's trace to `dest` and returns
  (its output, `summarize` of the trace plus `traced_us`, the traced
  kernel's CUPTI time). With D devices JAX writes a trace per device's
  kernel, or (JAX 0.11, one file name per kernel) the first one only; the
  first written is kept."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from collective_matmul import kernels  # pylint: disable=g-import-not-at-top
  from collective_matmul.autotuning import kernel_time_us  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as tmp:
    with kernels.trace_warpgroups(tmp, ranges), (
        jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
      f = build()
      # Earlier calls pay for first touches (e.g. of the peer's fresh
      # buffers); their traces are dropped (JAX 0.11 writes one file per
      # kernel name and does not overwrite it).
      for _ in range(warmup_calls):
        jax.block_until_ready(f(*operands))
        jax.effects_barrier()  # The trace is written by a host callback.
        for path in glob.glob(os.path.join(tmp, "*-trace.json")):
          os.remove(path)
      out = jax.block_until_ready(f(*operands))
      jax.effects_barrier()
      written = sorted(glob.glob(os.path.join(tmp, "*-trace.json")))
      if not written:
        raise RuntimeError(f"the kernel wrote no trace into {tmp}")
      shutil.copyfile(written[0], dest)
      # What the profiler costs: the traced kernel timed (it writes more
      # traces into tmp, which are dropped).
      _, traced_us, _ = kernel_time_us(f, *operands,
                                       iterations=timing_iterations)
      jax.effects_barrier()
  summary = summarize(load(dest))
  summary["file"] = os.path.basename(dest)
  summary["traced_us"] = traced_us
  # The SM clock the trace implies: the longest block's cycles per us.
  summary["implied_sm_clock_mhz"] = (
      summary["block_span_cycles"]["max"] / traced_us)
  return out, summary


def plot(tracks, path, max_blocks: int = 24):
  """A timeline of compute warpgroup 0 on up to `max_blocks` blocks."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  compute = sorted((t for t in tracks if t["wg"] == 0 and t["ranges"]),
                   key=lambda t: t["block"])
  step = max(1, len(compute) // max_blocks)
  shown = compute[::step][:max_blocks]
  colors = {"mma": "tab:blue", "epilogue": "tab:orange",
            "wait_arrival": "tab:red", "wait_partial_sum": "tab:red"}
  fig, ax = plt.subplots(figsize=(11, 0.28 * len(shown) + 1.5))
  for row, t in enumerate(shown):
    for name, b, e in t["ranges"]:
      ax.barh(row, (e - b) / 1e3, left=b / 1e3, height=0.8,
              color=colors.get(name, "tab:gray"), linewidth=0)
  ax.set_yticks(range(len(shown)), [f"block {t['block']}" for t in shown],
                fontsize=7)
  ax.invert_yaxis()
  ax.set_xlabel("k cycles since the block's first event")
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in
             ("tab:blue", "tab:orange", "tab:red")]
  ax.legend(handles, ["k loop (mma)", "epilogue", "wait"], loc="lower right",
            fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("trace", help="a *-trace.json from trace_warpgroups")
  parser.add_argument("--sm-clock-mhz", type=float, default=None,
                      help="to place the blocks' ends in time (tail)")
  parser.add_argument("--plot", default=None, help="write a timeline PNG")
  args = parser.parse_args()
  tracks = load(args.trace)
  print(json.dumps(summarize(tracks, args.sm_clock_mhz), indent=1))
  if args.plot:
    plot(tracks, args.plot)


if __name__ == "__main__":
  main()
