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


def test_maxtext_ab_help_is_its_whole_description():
  # argparse used to get the docstring's first line, cut mid-sentence.
  run = subprocess.run([sys.executable,
                        os.path.join(REPO_ROOT, "scripts", "maxtext_ab.py"),
                        "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO_ROOT)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "plugin off, plugin on, and (optionally) XLA's windowed einsum" in (
      " ".join(run.stdout.split()))
  assert "Only the first round is profiled." in run.stdout


@pytest.mark.parametrize("script", ["train.py", "ab_compare.py"])
def test_absl_script_help_exits_0_and_lists_the_plugins_flags(script):
  # absl ends --help with status 1.
  run = subprocess.run([sys.executable,
                        os.path.join(REPO_ROOT, "scripts", script), "--help"],
                       capture_output=True, text=True, timeout=120,
                       cwd=REPO_ROOT)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "--collective_matmul_impl" in run.stdout


@pytest.mark.parametrize("argv, quiet", [
    ([], True), (["--verbosity=0"], False), (["--v=1"], False)])
def test_xla_warnings_are_quiet_unless_verbosity_is_asked_for(argv, quiet):
  # XLA's C++ warnings (SPMD's "Involuntary full rematerialization") showed
  # although the scripts say they are quiet by default (issue 30, item 6).
  code = ("import os, sys; sys.path.insert(0, 'scripts'); "
          "sys.argv[1:] = sys.argv[2:]; import script_setup; "
          "script_setup.prepare(); "
          "print(os.environ.get('TF_CPP_MIN_LOG_LEVEL'))")
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  run = subprocess.run([sys.executable, "-c", code, "x", *argv],
                       capture_output=True, text=True, timeout=120,
                       cwd=REPO_ROOT, env=env)
  assert run.returncode == 0, run.stderr[-2000:]
  # 2: INFO and WARNING hidden, errors shown (JAX's own default is 1).
  assert (run.stdout.strip() == "2") == quiet, run.stdout


def test_maxtext_ab_help_says_what_each_arm_is_and_the_defaults():
  # It named its arms without saying what they are (issue 49, item 5).
  sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
  try:
    import maxtext_ab  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  run = subprocess.run([sys.executable,
                        os.path.join(REPO_ROOT, "scripts", "maxtext_ab.py"),
                        "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO_ROOT)
  assert run.returncode == 0, run.stderr[-2000:]
  text = " ".join(run.stdout.split())
  for name, arm in maxtext_ab.NAMED_ARMS.items():
    assert f"{name}: {' '.join(arm.description.split())}" in text, name
  assert "(default: off,auto,windowed)" in text
  assert "(default: 300)" in text
  assert "parse_arm" not in text
