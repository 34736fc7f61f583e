"""The autotune cache shared by several processes: writers that store at the
same time (two sweeps on one host, one per GPU pair) lose no entry, none of
them raises, and the file stays valid JSON throughout."""
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np

from collective_matmul import selection

PLUGIN_DIR = os.path.dirname(os.path.dirname(selection.__file__))

# One writer: signals it is ready, waits for the start file, then stores its
# entries (problem sizes and send gaps from the argument list) and checks
# after each store that the file is a JSON object.
_WRITER = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, sys.argv[1])
    from collective_matmul import selection
    ready, start, entries = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    open(ready, "w").close()
    while not os.path.exists(start):
      time.sleep(0.005)
    for m, gap in entries:
      config = selection.AllGatherConfig(send_gap=gap)
      selection.store_cached_config(
          config, selection.Problem(m, 512, 1024, "bfloat16", 2), "H200")
      with open(selection.cache_path()) as f:
        assert isinstance(json.load(f), dict)
""")


def _spawn_writers(tmp_path, per_writer):
  """Starts one process per entry list; returns them once all are ready."""
  start = tmp_path / "start"
  procs, ready = [], []
  for i, entries in enumerate(per_writer):
    ready.append(tmp_path / f"ready-{i}")
    procs.append(subprocess.Popen(
        [sys.executable, "-c", _WRITER, PLUGIN_DIR, str(ready[-1]),
         str(start), json.dumps(entries)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  deadline = time.monotonic() + 240
  while not all(r.exists() for r in ready):
    assert time.monotonic() < deadline, "writers did not start"
    assert all(p.poll() is None for p in procs), [
        p.communicate() for p in procs if p.poll() is not None]
    time.sleep(0.05)
  start.touch()
  return procs


def test_concurrent_writers_keep_every_entry(tmp_path, monkeypatch, rng):
  cache = tmp_path / "cache" / "tuning.json"
  monkeypatch.setenv("COLLECTIVE_MATMUL_TUNING_CACHE", str(cache))
  writers, count = 4, 30
  rows = rng.permutation(np.arange(1, writers * count + 1)) * 64
  per_writer = [[(int(rows[w * count + i]), int(rng.integers(1, 64)))
                 for i in range(count)] for w in range(writers)]
  procs = _spawn_writers(tmp_path, per_writer)
  for proc in procs:
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
  table = json.loads(cache.read_text())
  assert len(table) == writers * count
  for entries in per_writer:
    for m, gap in entries:
      problem = selection.Problem(m, 512, 1024, "bfloat16", 2)
      assert selection.load_cached_config(problem, "H200") == (
          selection.AllGatherConfig(send_gap=gap))
  # No temporary file is left beside the cache.
  assert {p.name for p in cache.parent.iterdir()} <= {
      "tuning.json", "tuning.json.lock"}
