"""scripts/ab_compare.py as a new user runs it (issue 15)."""
import os
import subprocess
import sys

import pytest

from host_test_utils import REPO_ROOT, TEST_MODEL_ARGS

AB = os.path.join(REPO_ROOT, "scripts", "ab_compare.py")


def _run(*args, timeout=300):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # The script chooses its own device count.
  return subprocess.run([sys.executable, AB, *args], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_a_mesh_without_the_pattern_is_flagged_and_reports_never_overwrite(
    tmp_path):
  args = ("model_configs/base.yml", *TEST_MODEL_ARGS, "steps=2",
          f"base_output_directory={tmp_path}", "--tag=nopattern",
          "--collective_matmul_impl=ring")
  first = _run(*args)
  assert first.returncode == 3, first.stdout + first.stderr
  assert "rewrote none of the" in first.stderr
  assert "ici_tensor_sequence_parallelism > 1" in first.stderr
  second = _run(*args)
  assert second.returncode == 3, second.stdout + second.stderr
  reports = sorted(os.listdir(tmp_path / "ab"))
  assert reports == ["nopattern", "nopattern-2"]
  assert not os.path.exists(os.path.join(REPO_ROOT, "benchmarks", "ab",
                                         "nopattern"))


@pytest.mark.parametrize("under", ["", "sub"])
def test_an_output_dir_that_is_or_is_under_a_file_is_refused_before_training(
    tmp_path, under):
  taken = tmp_path / "taken"
  taken.write_text("not a directory")
  run = _run("model_configs/base.yml", *TEST_MODEL_ARGS, "steps=2",
             f"base_output_directory={tmp_path}",
             f"--output_dir={taken / under if under else taken}",
             "--collective_matmul_impl=ring")
  assert run.returncode == 2, run.stdout + run.stderr
  assert run.stderr.strip().splitlines() == [
      f"storage error: cannot use {taken / under if under else taken} as "
      f"the --output_dir: {taken} is a file, not a directory (ENOTDIR)"]
  assert "compiled" not in run.stdout  # No arm ran.
  assert taken.read_text() == "not a directory"


@pytest.mark.parametrize("tolerance", ["-1", "nan"])
def test_a_negative_or_nan_loss_tolerance_is_a_flag_error(tmp_path,
                                                           tolerance):
  run = _run("model_configs/base.yml", *TEST_MODEL_ARGS, "steps=2",
             f"base_output_directory={tmp_path}",
             f"--relative_loss_tolerance={tolerance}")
  assert run.returncode == 2, run.stdout + run.stderr
  assert run.stderr.strip().splitlines() == [
      f"--relative_loss_tolerance: relative loss tolerance "
      f"{float(tolerance)} is not a finite number >= 0"]
  assert not os.listdir(tmp_path)  # Nothing ran, nothing written.
