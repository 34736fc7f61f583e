"""The rings (D = 2, 4 and 8) on one Hopper GPU, as D virtual ranks inside
one launch (`kernels.peers.VirtualRanks`): the product's kernels and ring
schedules, each peer a slice of stacked arrays, the SMs split into D
shares. The cases and the runner are `tools/rings_one_gpu.py`'s: every
config `selection` picks for the ring over the benchmark's shapes (bf16,
e4m3 x e4m3, e5m2 x e4m3 with a scale), the kernel tests' schedules,
shapes off the tiles, skewed ranks, and mutations (a dropped wait or
signal) that must fail. Each case runs in a worker process with its
output poisoned, against the f32 product of the same values; a hang is a
failure, never a hung run.

With CM_RINGS_LOG set, each result is appended there (JSON lines).
"""
import json
import os
import sys

import pytest

from gpu_env import HOPPER_COUNT

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                "tools"))
import rings_one_gpu as rings  # pylint: disable=g-import-not-at-top,wrong-import-position

KIND = rings._device_kind() if HOPPER_COUNT else rings.DEFAULT_KIND  # pylint: disable=protected-access
CASES = rings.cases(KIND)


@pytest.fixture(scope="module")
def runner():
  r = rings.Runner(hang_s=float(os.environ.get("CM_RINGS_HANG_S", 30)))
  r.worker_cmd += ["--device-kind", KIND]
  yield r
  r.close()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_ring_on_virtual_ranks(case, runner):
  result = runner.run(case.name)
  passed = rings.verdict(case, result)
  if os.environ.get("CM_RINGS_LOG"):
    with open(os.environ["CM_RINGS_LOG"], "a") as f:
      f.write(json.dumps(dict(result, passed=passed,
                              expect_fail=case.expect_fail,
                              config=repr(case.config))) + "\n")
  assert passed, result
