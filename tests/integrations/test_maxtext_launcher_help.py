"""The launcher's --help and its first checks come before MaxText is
imported (issue 49, item 5: --help took 12-16 s behind MaxText's import
noise and listed none of the plugin's flags), and a plugin flag written as
a MaxText key is pointed to its flag.

A stand-in `maxtext` package that fails on import sits first on the path,
so `maxtext_available()` is true and any import of MaxText fails the run:
these run, and mean the same, with or without MaxText installed."""
import os
import subprocess
import sys
import time

import pytest

from collective_matmul.integrations.maxtext import __main__ as launcher

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
MODULE = "collective_matmul.integrations.maxtext"
IMPORTED = "the stand-in maxtext package was imported"


@pytest.fixture
def fake_maxtext(tmp_path):
  package = tmp_path / "maxtext"
  package.mkdir()
  (package / "__init__.py").write_text(f"raise ImportError({IMPORTED!r})\n")
  return tmp_path


def _launch(fake_maxtext, *args):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(fake_maxtext), os.path.join(REPO_ROOT, "plugin"),
       env.get("PYTHONPATH", "")])
  start = time.monotonic()
  run = subprocess.run([sys.executable, "-m", MODULE, *args], cwd=REPO_ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
  return run, time.monotonic() - start


@pytest.mark.parametrize("flag", ["--help", "-h", "--helpshort"])
def test_help_lists_the_plugins_flags_without_importing_maxtext(
    fake_maxtext, flag):
  run, seconds = _launch(fake_maxtext, flag)
  assert run.returncode == 0, run.stdout + run.stderr
  assert IMPORTED not in run.stdout + run.stderr
  assert run.stdout.startswith(
      "MaxText's trainer with the collective matmul plugin installed.")
  for name in ("--[no]use_collective_matmul", "--collective_matmul_impl",
               "--[no]maxtext_shard_gpu_attention",
               "--[no]maxtext_allow_untested_version"):
    assert name in run.stdout
  assert run.stdout.strip().endswith(launcher.MAXTEXT_OPTIONS_NOTE)
  assert seconds < 60, seconds  # Measured: about 1 s.


def test_helpfull_prints_the_plugins_flags_before_importing_maxtext(
    fake_maxtext):
  run, _ = _launch(fake_maxtext, "--helpfull")
  assert "--[no]use_collective_matmul" in run.stdout
  assert IMPORTED in run.stderr  # MaxText's own flags come after.


@pytest.mark.parametrize("written, flag", [
    ("use_collective_matmul=True", "write --use_collective_matmul"),
    ("collective_matmul_impl=ring", "write --collective_matmul_impl=ring"),
    ("maxtext_shard_gpu_attention=false",
     "write --nomaxtext_shard_gpu_attention"),
])
def test_a_plugin_flag_written_as_a_maxtext_key_is_pointed_to_its_flag(
    fake_maxtext, written, flag):
  run, _ = _launch(fake_maxtext, "configs/base.yml", "run_name=x", written)
  assert run.returncode == 2, run.stdout + run.stderr
  assert IMPORTED not in run.stderr
  [line] = [x for x in run.stderr.splitlines() if x.strip()]
  assert f"{written}: not a MaxText config key but the plugin's flag" in line
  assert flag in line


def test_the_launchers_flags_are_the_plugins_and_the_glues():
  names = launcher.plugin_flag_names()
  assert names["use_collective_matmul"] is True
  assert names["collective_matmul_impl"] is False
  assert {"maxtext_shard_gpu_attention",
          "maxtext_allow_untested_version"} <= set(names)


def test_without_maxtext_on_python_311_the_message_says_it_needs_312():
  message = launcher.maxtext_missing((3, 11))
  assert "MaxText needs Python >= 3.12 and this is Python 3.11" in message
  assert 'pip install -e ".[maxtext]" installs no MaxText' in message
  assert "this is" not in launcher.maxtext_missing((3, 12))
