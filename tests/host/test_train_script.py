"""scripts/train.py as the README runs it."""
import json
import os
import re
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


def test_first_hour_run_is_quiet_parsable_and_records_metrics(tmp_path):
  run = _run("model_configs/base.yml", "model_name=tiny",
             "base_num_decoder_layers=1", "max_target_length=32", "steps=3",
             "log_period=1", "enable_checkpointing=False", "run_name=first",
             f"base_output_directory={tmp_path}", "--use_collective_matmul",
             "--collective_matmul_impl=ring")
  assert run.returncode == 0, run.stdout + run.stderr
  # MaxText's step line, which log tools parse.
  lines = [l for l in run.stdout.splitlines()
           if l.startswith("completed step: ")]
  assert len(lines) == 3
  assert all(re.fullmatch(
      r"completed step: \d+, seconds: [\d.]+, TFLOP/s/device: [\d.]+, "
      r"Tokens/s/device: [\d.]+, loss: [\d.]+(, MFU: [\d.]+%)?", l)
             for l in lines), lines
  # One decision table, no INFO log by default.
  assert run.stdout.count("dot_generals rewritten") == 1
  assert not [l for l in run.stderr.splitlines() if l.startswith("I")]
  metrics = tmp_path / "first" / "metrics.jsonl"
  records = [json.loads(l) for l in metrics.read_text().splitlines()]
  assert [r["step"] for r in records] == [0, 1, 2]
  assert all(r["perf/per_device_tokens_per_sec"] > 0 for r in records)
  assert os.listdir(tmp_path / "first" / "tensorboard")
  # One process, said in the singular (issue 30, item 6).
  assert " devices (1 process), global batch " in run.stdout


def test_a_mesh_without_the_pattern_says_what_to_set(tmp_path):
  run = _run("model_configs/base.yml", "model_name=tiny",
             "base_num_decoder_layers=1", "max_target_length=32", "steps=1",
             "enable_checkpointing=False", f"base_output_directory={tmp_path}",
             "--use_collective_matmul", "--collective_matmul_impl=ring")
  assert run.returncode == 0, run.stdout + run.stderr
  assert "collective matmul: 0 of " in run.stdout
  assert "ici_tensor_sequence_parallelism > 1" in run.stdout


def test_help_lists_the_plugin_flags():
  run = _run("--help", timeout=60)
  assert "--use_collective_matmul" in run.stdout + run.stderr
  assert "--collective_matmul_impl" in run.stdout + run.stderr
