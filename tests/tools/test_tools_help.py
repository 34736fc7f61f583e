"""Every GPU tool answers --help without a GPU (issue 15: plot_kernels.py
crashed on it), and bench_gemm_core.py rejects bad arguments before any
GPU work."""
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _run(tool, *args):
  return subprocess.run([sys.executable,
                         os.path.join(REPO_ROOT, "tools", tool), *args],
                        capture_output=True, text=True, timeout=120,
                        cwd=REPO_ROOT)


@pytest.mark.parametrize("tool", ["plot_kernels.py", "plot_gemm_core.py",
                                  "bench_kernels.py",
                                  "bench_gemm_core.py", "warpgroup_trace.py"])
def test_tool_help_exits_cleanly(tool):
  run = _run(tool, "--help")
  assert run.returncode == 0, run.stderr[-2000:]
  assert "usage" in run.stdout.lower()


@pytest.mark.parametrize("args,message", [
    (["--shapes", "16384/4096"], "expected M/K/N"),
    (["--power-seconds", "-1"], "must be >= 0"),
    (["--fp8-forward", "--skip-fp8"], "drop --skip-fp8"),
    (["--only", "ours_fp8", "cublas_fp9"], "--only cublas_fp9: no such arm"),
    (["--only", "xla_fp8_fwd"], "--only xla_fp8_fwd: no such arm"),
])
def test_bench_gemm_core_rejects_bad_arguments(args, message):
  run = _run("bench_gemm_core.py", *args)
  assert run.returncode == 2
  assert message in run.stderr
