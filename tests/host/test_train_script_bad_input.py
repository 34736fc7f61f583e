"""Bad input to scripts/train.py and scripts/ab_compare.py: one line on
stderr, a non-zero exit, no traceback, and nothing trained (issue 33, items
8 and 9). The config loader's own checks are in test_config_validation.py;
these are the cases only the command line shows."""
import os
import subprocess
import sys

import jax
import pytest

from reference_host import config as config_lib
from reference_host import trainer as trainer_lib

from host_test_utils import BASE_CONFIG, REPO_ROOT

TRAIN = os.path.join(REPO_ROOT, "scripts", "train.py")
AB_COMPARE = os.path.join(REPO_ROOT, "scripts", "ab_compare.py")
TINY = ("model_configs/base.yml", "model_name=tiny",
        "base_num_decoder_layers=1", "max_target_length=32", "steps=1",
        "enable_checkpointing=False")
# What jax.distributed.initialize() reads to find a coordinator.
_CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                "JAX_PROCESS_ID", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri",
                "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES")


def _run(script, *args, timeout=120):
  env = {k: v for k, v in os.environ.items()
         if k != "XLA_FLAGS" and k not in _CLUSTER_ENV}
  return subprocess.run([sys.executable, script, *args], cwd=REPO_ROOT,
                        env=env, capture_output=True, text=True,
                        timeout=timeout)


def _one_line_error(run, returncode) -> str:
  assert run.returncode == returncode, run.stdout + run.stderr
  assert "Traceback" not in run.stderr, run.stderr
  lines = [line for line in run.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, run.stderr
  assert "completed step" not in run.stdout
  return lines[0]


def test_a_negative_data_shuffle_seed_is_a_config_error(tmp_path):
  line = _one_line_error(_run(TRAIN, *TINY, "data_shuffle_seed=-1",
                              f"base_output_directory={tmp_path}"), 2)
  assert line.startswith("config error: data_shuffle_seed=-1 (from "
                         "command-line overrides)")
  assert not os.listdir(tmp_path)


def test_a_binary_base_file_is_a_config_error(tmp_path):
  binary = tmp_path / "model.yml"
  binary.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(range(256)))
  line = _one_line_error(_run(TRAIN, str(binary)), 2)
  assert line.startswith(f"config error: base config: {binary} is not a "
                         "YAML text file")


def test_a_run_name_with_a_path_writes_nothing(tmp_path):
  base = tmp_path / "runs"
  base.mkdir()
  line = _one_line_error(_run(TRAIN, *TINY, "run_name=../escape",
                              f"base_output_directory={base}"), 2)
  assert "run_name='../escape'" in line and "must be a name" in line
  assert not (tmp_path / "escape").exists()
  assert not os.listdir(base)


def test_distributed_without_a_coordinator_says_what_to_set():
  line = _one_line_error(_run(TRAIN, *TINY, "--distributed"), 2)
  assert line.startswith("--distributed: jax.distributed.initialize() "
                         "failed:")
  assert "JAX_COORDINATOR_ADDRESS" in line


def test_a_strict_fallback_is_one_line(tmp_path):
  """On CPU the pallas kernels cannot run: --collective_matmul_strict
  refuses the ring fallback, in one line naming the layer and the reason."""
  line = _one_line_error(_run(
      TRAIN, *TINY, "ici_tensor_sequence_parallelism=4", "run_name=strict",
      f"base_output_directory={tmp_path}", "--use_collective_matmul",
      "--collective_matmul_impl=pallas", "--collective_matmul_strict"), 1)
  assert line.startswith("collective matmul (strict): layers_0/")
  assert "pallas unavailable" in line


def test_a_model_beyond_the_memory_fails_fast_in_one_line(tmp_path):
  """base.yml's model with a 1M-wide embedding: terabytes. Refused before
  anything is allocated (it used to run for minutes with no output)."""
  line = _one_line_error(_run(
      TRAIN, "model_configs/base.yml", "base_emb_dim=1048576", "steps=1",
      f"base_output_directory={tmp_path}", timeout=60), 2)
  assert line.startswith("config error: the model does not fit: it needs "
                         "at least")
  assert "base_emb_dim=1048576" in line
  assert not os.listdir(tmp_path)


def test_an_unknown_baseline_xla_option_is_refused_before_training(tmp_path):
  line = _one_line_error(_run(
      AB_COMPARE, *TINY, "ici_tensor_sequence_parallelism=4",
      f"base_output_directory={tmp_path}",
      "--baseline_xla_option=xla_nonexistent_option=1"), 2)
  assert line.startswith("--baseline_xla_option: XLA refuses")
  assert "xla_nonexistent_option" in line
  assert not os.listdir(tmp_path)


def test_ab_compare_distributed_without_a_coordinator_is_one_line():
  line = _one_line_error(_run(AB_COMPARE, *TINY, "--distributed"), 2)
  assert line.startswith("--distributed: jax.distributed.initialize() "
                         "failed:")


def test_the_trainer_checks_memory_before_initialising():
  """Library users (the A/B harness, tests) get the check too: init_state
  refuses before allocating."""
  config = config_lib.load_config(
      [BASE_CONFIG, "model_name=tiny", "vocab_size=1000000000"],
      num_devices=jax.device_count())
  trainer = trainer_lib.Trainer(config)
  available, where = trainer_lib.available_memory(jax.devices())
  assert available > 2**30 and "host memory" in where
  with pytest.raises(config_lib.ConfigError,
                     match="the model does not fit.*vocab_size=1000000000"):
    trainer.init_state()


def test_a_mesh_larger_than_the_machine_is_blamed_on_the_devices():
  # Was: "base_num_query_heads=8 is not divisible by 16" (issue 30, item 6).
  line = _one_line_error(_run(TRAIN, *TINY,
                              "ici_tensor_sequence_parallelism=16"), 2)
  assert "ici_tensor_sequence_parallelism=16" in line
  assert "8 devices" in line and "heads" not in line
