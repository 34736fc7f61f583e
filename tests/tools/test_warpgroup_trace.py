"""tools/warpgroup_trace.py reads the traces JAX's Mosaic GPU profiler
writes: built here with JAX's own `ProfilerSpec.dump` from a buffer laid out
as the on-device profiler fills it."""
import json

import numpy as np
import pytest

from cm_test_utils import import_script

profiler = pytest.importorskip("jax.experimental.mosaic.gpu.profiler")


def _script():
  return import_script("warpgroup_trace")


def _write_trace(path, blocks):
  """blocks: per block, per warpgroup (3), a list of (name, begin, end) in
  cycles (non-overlapping or nested). Returns the path."""
  spec = profiler.ProfilerSpec(64)
  entries = np.zeros((len(blocks), 3, 64), np.uint32)
  for b, wgs in enumerate(blocks):
    for w, ranges in enumerate(wgs):
      events = []
      for name, begin, end in ranges:
        tag = spec.intern_name(name)
        events += [(begin, 0, tag), (end, 1, tag | spec.EXIT)]
      events.sort()
      flat = [x for t, _, tag in events for x in (tag, t + 100)]
      entries[b, w, 0] = 5_000 + 10 * b  # Global start (ns).
      entries[b, w, 1] = b  # SM.
      entries[b, w, 2] = len(flat)
      entries[b, w, 3:3 + len(flat)] = flat
  with open(path, "w") as f:
    spec.dump(entries.reshape(-1), f, grid=(len(blocks),), block=(384,))
  return path


def _tiles(*tiles, gap=50):
  """Compute-warpgroup ranges of back-to-back tiles (mma, epilogue) cycles.
  The epilogue opens a cycle after the k loop closes: JAX takes the smallest
  step between two events, less one, as the profiler's own cost per event
  and subtracts it, so these traces keep a 1-cycle step to stay exact."""
  out, t = [], 0
  for mma, epi in tiles:
    out += [("mma", t, t + mma), ("epilogue", t + mma + 1, t + mma + 1 + epi)]
    t += mma + 1 + epi + gap
  return out


def test_per_tile_phases_and_block_spans(tmp_path):
  wt = _script()
  block0 = _tiles((1000, 200), (1000, 200))
  block1 = _tiles((1000, 300), (1200, 200), gap=80)
  path = _write_trace(tmp_path / "t.json", [
      [block0, block0, []], [block1, block1, []]])
  tracks = wt.load(path)
  # A warpgroup that recorded nothing (here the memory one) has no track.
  assert [(t["block"], t["wg"], t["sm"]) for t in tracks] == [
      (0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
  assert [r[0] for r in tracks[0]["ranges"]] == ["mma", "epilogue"] * 2
  s = wt.summarize(tracks)
  assert s["blocks"] == 2 and s["tiles"] == 4
  assert s["median_cycles"] == {"mma": 1000, "epilogue": 200, "gap": 65}
  assert s["max_cycles"]["mma"] == 1200
  assert s["block_span_cycles"] == {"median": (2452 + 2782) / 2,
                                    "min": 2452, "max": 2782}
  assert s["median_share_of_span"]["epilogue"] == pytest.approx(
      (400 / 2452 + 500 / 2782) / 2)
  assert s["ranges"] == {"mma": 4, "epilogue": 4}
  # By a block's tile index: the 1st tiles (1000 and 1000 cycles of k
  # loop; epilogues 200 and 300), the 2nd (1000 and 1200; gaps 50, 80).
  assert s["per_tile_index"] == [
      {"index": 0, "blocks": 2, "mma": 1000, "epilogue": 250, "gap": None},
      {"index": 1, "blocks": 2, "mma": 1100, "epilogue": 200, "gap": 65}]


def test_a_wait_nested_in_an_epilogue_is_kept(tmp_path):
  wt = _script()
  ranges = [("mma", 0, 1000), ("epilogue", 1001, 1400),
            ("wait_partial_sum", 1010, 1300)]
  path = _write_trace(tmp_path / "t.json", [[ranges, ranges, []]])
  s = wt.summarize(wt.load(path), sm_clock_mhz=1000.0)
  assert s["ranges"]["wait_partial_sum"] == 1
  assert s["median_share_of_span"]["wait_partial_sum"] == pytest.approx(
      290 / 1400)
  # At 1 GHz a cycle is a ns: the block ends 1400 ns after its start.
  assert s["tail_ns"]["last_block_end"] == pytest.approx(1400)


def test_a_trace_without_compute_ranges_is_refused(tmp_path):
  wt = _script()
  path = _write_trace(tmp_path / "t.json", [[[], [], [("mma", 0, 5)]]])
  with pytest.raises(ValueError, match="trace_warpgroups"):
    wt.summarize(wt.load(path))


def test_the_timeline_plot_is_written(tmp_path):
  pytest.importorskip("matplotlib")
  wt = _script()
  path = _write_trace(tmp_path / "t.json",
                      [[_tiles((1000, 200)), [], []]] * 3)
  wt.plot(wt.load(path), tmp_path / "t.png")
  assert (tmp_path / "t.png").stat().st_size > 1000
  with open(path) as f:
    assert json.load(f)["traceEvents"]


def test_run_traced_keeps_the_trace_of_the_call_after_the_warmups(
    tmp_path, monkeypatch):
  """Each call of a traced kernel writes a trace into the active
  `trace_warpgroups` directory (faked here: call i writes i + 1 tiles);
  `run_traced` drops the warm-up calls' traces and keeps the next one's."""
  wt = _script()
  from collective_matmul import autotuning  # pylint: disable=g-import-not-at-top
  from collective_matmul.kernels import tracing  # pylint: disable=g-import-not-at-top
  calls = []

  def kernel(x):
    calls.append(x)
    trace_dir = tracing._TRACE.get().dump_dir  # pylint: disable=protected-access
    tiles = [(1000, 200)] * len(calls)
    _write_trace(f"{trace_dir}/{len(calls)}-trace.json",
                 [[_tiles(*tiles), [], []]])
    return x + 1

  monkeypatch.setattr(autotuning, "kernel_time_us",
                      lambda f, *a, iterations: (f(*a), 12.5, {}))
  out, summary = wt.run_traced(lambda: kernel, (41,), 8,
                               str(tmp_path / "kept.json"), warmup_calls=2)
  assert out == 42
  assert summary["tiles"] == 3  # The third call's trace.
  assert summary["traced_us"] == 12.5 and summary["file"] == "kept.json"
  assert len(calls) == 4  # 2 warm-ups, the traced call, the timing.
