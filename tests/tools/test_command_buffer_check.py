"""The GPU checks of the kernels under XLA's command buffers, without a
GPU: tools/command_buffer_check.py traces every arm (and lowers the
kernels' programs for CUDA on JAX >= 0.12), and multiprocess_check.py's
CM_MP_AUTO mode runs end to end over two CPU processes (ring against
baseline: `auto` picks the ring off a GPU), so a GPU call finds neither
broken."""
import os
import socket
import subprocess
import sys

import jax
import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import command_buffer_check as cb  # pylint: disable=g-import-not-at-top,wrong-import-position
from cm_test_utils import wait_for_processes  # pylint: disable=g-import-not-at-top,wrong-import-position

_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])


def test_every_arm_traces(capsys):
  assert cb.main(["--plan"]) == 0
  out = capsys.readouterr().out
  for arm in cb.ARMS:
    if arm == "fp8_d2" and _VERSION < (0, 11):
      assert f"{arm}: skipped" in out, out
    else:
      assert f"{arm}: traced" in out, out


@pytest.mark.skipif(_VERSION < (0, 12), reason="lowering Mosaic GPU for "
                    "CUDA without a GPU needs JAX >= 0.12")
def test_the_kernels_arms_lower_for_cuda(capsys):
  assert cb.main(["--plan", "--arms", "virtual_d2,fp8_d2,mutation_d2"]) == 0
  out = capsys.readouterr().out
  assert out.count("lowered for CUDA") == 3, out


@pytest.mark.parametrize("argv,says", [
    (["--plan", "--arms", "virtual_d3"], "unknown arms"),
    (["--plan", "--calls", "0"], "must be >= 1")])
def test_bad_arguments_are_usage_errors(argv, says, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cb.main(argv)
  assert exit_info.value.code == 2
  assert says in capsys.readouterr().err


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_the_two_process_auto_check_runs_on_cpu():
  port = str(_free_port())
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
             CM_MP_AUTO="1", CM_MP_CALLS="5", CM_MP_PORT=port,
             XLA_FLAGS="--xla_force_host_platform_device_count=1",
             PYTHONPATH=os.pathsep.join(
                 os.path.abspath(os.path.join(ROOT, p))
                 for p in ("plugin", "host", "tests", "tools")))
  script = os.path.join(ROOT, "tests", "gpu", "multiprocess_check.py")
  procs = [subprocess.Popen([sys.executable, script],
                            env=dict(env, RANK=str(rank)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for rank in (0, 1)]
  logs = wait_for_processes(procs, 300, "the two-process check hung")
  for proc, log in zip(procs, logs):
    assert proc.returncode == 0, log[-3000:]
    for case in ("bf16_train", "fp8_all_gather", "fp8_reduce_scatter"):
      assert f"OK {case} calls 5" in log, log[-3000:]
  decided = [[line for line in log.splitlines() if line.startswith("DECIDE")]
             for log in logs]
  assert decided[0] == decided[1] and decided[0]
  assert "rewritten -> ring" in "\n".join(decided[0])
