"""Every user script answers --help (issue 15: a script crashed on it)."""
import os
import subprocess
import sys

import pytest

from host_test_utils import REPO_ROOT


@pytest.mark.parametrize("script", ["maxtext_ab.py", "autotune.py"])
def test_script_help_exits_cleanly(script):
  run = subprocess.run([sys.executable,
                        os.path.join(REPO_ROOT, "scripts", script), "--help"],
                       capture_output=True, text=True, timeout=120,
                       cwd=REPO_ROOT)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "usage" in run.stdout.lower()
