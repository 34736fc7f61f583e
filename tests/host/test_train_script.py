"""scripts/train.py as the README runs it."""
import os
import subprocess
import sys

from host_test_utils import REPO_ROOT

TRAIN = os.path.join(REPO_ROOT, "scripts", "train.py")


def _run(*args, timeout=300):
  env = dict(os.environ)
  # The script chooses its own emulated device count.
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, TRAIN, *args], cwd=REPO_ROOT,
                        env=env, capture_output=True, text=True,
                        timeout=timeout)


def test_no_argument_demo_rewrites_layers_and_matches_baseline():
  run = _run()
  assert run.returncode == 0, run.stdout + run.stderr
  assert "rewritten -> " in run.stdout
  assert "layers_0/mlp/wi_0" in run.stdout
  assert "loss matches the baseline" in run.stdout


def test_bad_mesh_is_reported_by_key_before_compiling():
  run = _run("model_configs/base.yml", "model_name=tiny",
             "ici_data_parallelism=3", timeout=60)
  assert run.returncode == 2
  assert "ici_data_parallelism=3" in run.stderr
  assert "compiled" not in run.stdout


def test_resumes_from_latest_checkpoint(tmp_path):
  common = ("model_configs/base.yml", "model_name=tiny",
            "base_num_decoder_layers=1", "max_target_length=32",
            f"base_output_directory={tmp_path}", "run_name=resume",
            "checkpoint_period=2",
            "--use_collective_matmul", "--collective_matmul_impl=ring")
  first = _run(*common, "steps=2")
  assert first.returncode == 0, first.stdout + first.stderr
  second = _run(*common, "steps=3")
  assert second.returncode == 0, second.stdout + second.stderr
  assert "resumed from checkpoint step 2" in second.stdout
  assert "done: steps 2..2" in second.stdout
