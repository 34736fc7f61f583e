"""tools/gpu_check.sh without a GPU: every step its header names is one it
runs (and no other), an unknown step is refused, and the one-GPU steps
(`rings`, `core`) run their tools as a GPU call would, here with `--plan`
(traced on CPU)."""
import os
import re
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, "tools", "gpu_check.sh")


def _run(out, *steps, **env):
  return subprocess.run(
      ["bash", SCRIPT, str(out), *steps], cwd=REPO_ROOT, capture_output=True,
      text=True, timeout=600,
      env=dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ["PATH"], **env))


def test_the_header_names_every_step_it_runs():
  text = open(SCRIPT).read()
  header = text.split("# Steps:")[1].split("# Step timeouts")[0]
  named = set(re.findall(r"^#   (\w+)", header, re.M))
  branches = {name for names in re.findall(r"^    ([\w|*]+)\)$", text, re.M)
              for name in names.split("|") if "*" not in name}
  assert named == branches, (named ^ branches)
  assert {"rings", "core", "tests_d1"} <= named


def test_an_unknown_step_is_refused(tmp_path):
  result = _run(tmp_path, "no_such_step")
  assert result.returncode == 2
  assert "unknown step 'no_such_step'" in result.stdout


def test_the_one_gpu_steps_run_their_tools(tmp_path):
  result = _run(tmp_path, "core", "rings", CORE_SHAPES="2048/4096/4096",
                CORE_ARGS="--plan", RINGS_ARGS="--plan --only all_gather/default/d2")
  assert result.returncode == 0, result.stdout + result.stderr
  assert "== core_2048_4096_4096 rc=0" in result.stdout
  assert "== rings rc=0" in result.stdout
  assert "planned 1 cases" in (tmp_path / "rings.log").read_text()
  core_log = (tmp_path / "core_2048_4096_4096.log").read_text()
  assert "2048/4096/4096 ours_ag" in core_log and "plan:" in core_log


def test_the_rowwise_step_runs_its_tests_and_tools(tmp_path):
  """The GPU tests skip here (no Hopper GPU); the rings' case and the
  eight fp8 arms are planned."""
  result = _run(tmp_path, "rowwise", CORE_SHAPES="2048/4096/4096",
                CORE_ARGS="--plan",
                RINGS_ARGS="--plan --only all_gather/rowwise/rows/d2")
  assert result.returncode == 0, result.stdout + result.stderr
  for step in ("rowwise_tests", "rowwise_rings",
               "rowwise_core_2048_4096_4096"):
    assert f"== {step} rc=0" in result.stdout, result.stdout
  assert "skipped" in (tmp_path / "rowwise_tests.log").read_text()
  assert "planned 1 cases" in (tmp_path / "rowwise_rings.log").read_text()
  core_log = (tmp_path / "rowwise_core_2048_4096_4096.log").read_text()
  assert "2048/4096/4096 ours_fp8_rowwise" in core_log, core_log
  assert "2048/4096/4096 ours_ag " not in core_log, core_log


INSTALLED = os.path.join(REPO_ROOT, "tools", "gpu_installed_setup.sh")


def test_the_installed_setup_script_names_every_step_it_runs(tmp_path):
  text = open(INSTALLED).read()
  header = text.split("# Steps")[1].split("set -u")[0]
  named = set(re.findall(r"\b(\w+_0\d\d|\w+_image|facts)\b", header))
  branches = set()
  for pattern in re.findall(r"^    ([\w|]+)\)", text, re.M):
    branches |= set(pattern.split("|"))
  assert named == branches, (named ^ branches)
  result = subprocess.run(["bash", INSTALLED, str(tmp_path / "out"),
                           "no_such_step"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 2
  assert "unknown step 'no_such_step'" in result.stdout
