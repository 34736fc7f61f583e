"""scripts/autotune.py's input: a sweep needs Hopper GPUs, which it says in
one line before any work, and counts that would time nothing are refused
in every mode."""
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _autotune(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
      [sys.executable, os.path.join(REPO_ROOT, "scripts", "autotune.py"),
       *args], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
      env=env)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_a_sweep_without_hopper_gpus_is_one_line_and_a_failure(collective):
  run = _autotune("--collective", collective, "--shapes", "256/512/512")
  assert run.returncode == 1, (run.stdout[-2000:], run.stderr[-2000:])
  lines = (run.stdout + run.stderr).strip().splitlines()
  assert len(lines) == 1, lines
  assert "needs Hopper GPUs" in lines[0] and "--plan D" in lines[0]


MODES = {"sweep": (), "plan": ("--plan", "2")}
COUNTS = [("--iterations", "0"), ("--finalists", "0"), ("--rounds", "-1"),
          ("--rounds", "0"), ("--iterations", "-3")]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("flag,value", COUNTS)
def test_a_count_below_one_is_refused(mode, flag, value):
  run = _autotune(*MODES[mode], "--shapes", "256/512/512", flag, value)
  assert run.returncode == 2, (run.stdout[-2000:], run.stderr[-2000:])
  assert f"{flag} {value}" in run.stderr and "must be >= 1" in run.stderr
  assert "Traceback" not in run.stderr
