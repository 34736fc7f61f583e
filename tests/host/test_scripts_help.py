"""Every script answers --help (issue 15: plot_kernels.py crashed)."""
import os
import subprocess
import sys

import pytest

from host_test_utils import REPO_ROOT


@pytest.mark.parametrize("script", ["plot_kernels.py", "maxtext_ab.py",
                                    "autotune.py", "bench_kernels.py",
                                    "bench_gemm_core.py"])
def test_script_help_exits_cleanly(script):
  run = subprocess.run([sys.executable,
                        os.path.join(REPO_ROOT, "scripts", script), "--help"],
                       capture_output=True, text=True, timeout=120,
                       cwd=REPO_ROOT)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "usage" in run.stdout.lower()


@pytest.mark.parametrize("args,message", [
    (["--shapes", "16384/4096"], "expected M/K/N"),
    (["--power-seconds", "-1"], "must be >= 0"),
])
def test_bench_gemm_core_rejects_bad_arguments(args, message):
  run = subprocess.run([sys.executable,
                        os.path.join(REPO_ROOT, "scripts", "bench_gemm_core.py"),
                        *args],
                       capture_output=True, text=True, timeout=120,
                       cwd=REPO_ROOT)
  assert run.returncode == 2
  assert message in run.stderr
