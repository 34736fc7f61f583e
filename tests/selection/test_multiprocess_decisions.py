"""Every process decides the same (a ring where one device took another path
hangs): two CPU processes under jax.distributed trace the same program, one
with a different local autotune cache, and compare their decision records."""
import json
import os
import socket
import subprocess
import sys

import pytest

from cm_test_utils import wait_for_processes
from collective_matmul import selection

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _cache_with(path, tile_n):
  key = selection.cache_key(selection.Problem(256, 512, 1024, "bfloat16", 4),
                            device_kind="cpu")
  config = selection.AllGatherConfig(tile_m=128, tile_n=tile_n)
  path.write_text(json.dumps({key: config.to_json()}))
  return str(path)


def _run_two_processes(tmp_path, caches, nccl=(None, None)):
  port = str(_free_port())
  procs, outs = [], []
  for pid in range(2):
    out = tmp_path / f"decisions_{pid}.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["COLLECTIVE_MATMUL_TUNING_CACHE"] = caches[pid]
    if nccl[pid]:
      env["CM_FAKE_NCCL"] = nccl[pid]
    procs.append(subprocess.Popen(
        [sys.executable, os.path.join(HERE, "multiprocess_decisions.py"),
         str(pid), port, str(out)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True))
    outs.append(out)
  logs = wait_for_processes(
      procs, 240, "a process hung (a ring where the processes disagree)")
  for proc, log in zip(procs, logs):
    assert proc.returncode == 0, log[-4000:]
  return [json.loads(out.read_text()) for out in outs]


def test_two_processes_with_different_local_caches_decide_the_same(tmp_path):
  caches = [_cache_with(tmp_path / "cache0.json", 128),
            _cache_with(tmp_path / "cache1.json", 64)]
  first, second = _run_two_processes(tmp_path, caches)
  assert first["decisions"] == second["decisions"]
  assert [d.split(":")[0] for d in first["decisions"]] == [
      "wi (4, 32, 64)x(64, 32) float32", "wo (4, 32, 32)x(32, 64) float32"]
  assert all(" rewritten -> ring over 'tensor'" in d
             for d in first["decisions"])
  # A per-host cache never changes a choice in a multi-process program.
  assert first["config"] == second["config"]
  assert first["max_abs_error"] < 1e-4 and second["max_abs_error"] < 1e-4


@pytest.mark.parametrize("nccl,impl,says", [
    (("2.32.6", "2.30.7"), "pallas", ""),
    (("2.32.6", "2.28.9"), "baseline", "NCCL 2.28.9"),
    (("2.28.9", "2.32.6"), "baseline", "NCCL 2.28.9"),
    (("2.32.6", "none"), "baseline", "NCCL version unknown"),
])
def test_processes_with_different_nccl_decide_from_the_lowest(
    tmp_path, nccl, impl, says):
  # One process per GPU: the ring over both processes' devices needs NCCL's
  # peer pointers on every process; each decides from the job's lowest
  # version (exchanged through jax.distributed's key-value store).
  empty = str(tmp_path / "no_cache.json")
  first, second = _run_two_processes(tmp_path, [empty, empty], nccl)
  assert first["nccl"]["job"] == second["nccl"]["job"]
  assert [first["nccl"]["own"], second["nccl"]["own"]] == [
      None if v == "none" else [int(x) for x in v.split(".")] for v in nccl]
  assert first["nccl"]["impl"] == second["nccl"]["impl"] == impl
  assert first["nccl"]["reason"] == second["nccl"]["reason"]
  assert says in first["nccl"]["reason"]
