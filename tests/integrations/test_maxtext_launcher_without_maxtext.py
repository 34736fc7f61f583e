"""`python -m collective_matmul.integrations.maxtext` where MaxText is not
installed (Python 3.11, or 3.12 without the extra): one line saying what to
install, and --help still shows the launcher's usage (issue 33, item 10).

MaxText's absence is made certain in the child (`sys.modules["maxtext"] =
None`), so these run, and mean the same, where MaxText is installed too."""
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
MODULE = "collective_matmul.integrations.maxtext"
_WITHOUT_MAXTEXT = (
    "import runpy, sys; sys.modules['maxtext'] = None; "
    f"runpy.run_module({MODULE!r}, run_name='__main__', alter_sys=True)")


def _launch(*args):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [os.path.join(REPO_ROOT, "plugin"), env.get("PYTHONPATH", "")])
  return subprocess.run([sys.executable, "-c", _WITHOUT_MAXTEXT, *args],
                        cwd=REPO_ROOT, env=env, capture_output=True,
                        text=True, timeout=120)


def _says_what_to_install(line):
  assert "Python >= 3.12" in line, line
  assert 'pip install -e ".[maxtext]"' in line, line


@pytest.mark.parametrize("args", [
    (), ("configs/base.yml", "run_name=x", "--use_collective_matmul")])
def test_a_launch_without_maxtext_is_one_line_naming_what_to_install(args):
  run = _launch(*args)
  assert run.returncode != 0
  assert "Traceback" not in run.stderr, run.stderr
  lines = [line for line in run.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, run.stderr
  _says_what_to_install(lines[0])
  assert not run.stdout


@pytest.mark.parametrize("flag", ["--help", "-h", "--helpfull"])
def test_help_without_maxtext_shows_the_launchers_usage(flag):
  run = _launch(flag)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "Traceback" not in run.stderr, run.stderr
  assert f"python -m {MODULE}" in run.stdout
  # The plugin's flags, which need no MaxText.
  assert "--[no]use_collective_matmul" in run.stdout
  assert "--collective_matmul_impl" in run.stdout
  assert "--[no]maxtext_shard_gpu_attention" in run.stdout
  _says_what_to_install(run.stdout.strip().splitlines()[-1])
