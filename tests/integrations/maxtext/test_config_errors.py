"""The launcher says MaxText's config errors in one line naming the key,
and exits 2 (issue 39, item 9: they were 48 to 916 line tracebacks).
These errors come before any training: the config is read, not run."""
import os
import subprocess
import sys

import pytest

from collective_matmul.integrations.maxtext import config_errors
import maxtext_runs

_MODULE = "collective_matmul.integrations.maxtext"


def _argv(tmp_path, *extra, config_file=None):
  return ["launcher", config_file or maxtext_runs.maxtext_base_yml(),
          "run_name=config_errors", f"base_output_directory={tmp_path}",
          "hardware=cpu", "skip_jax_distributed_system=True",
          "dataset_type=synthetic", "steps=1", "enable_checkpointing=False",
          "log_config=False", *extra]


def _read_config(argv):
  """MaxText's pyconfig on `argv` within `in_one_line`: what it raised."""
  from maxtext.configs import pyconfig  # pylint: disable=g-import-not-at-top
  with pytest.raises(config_errors.MaxTextConfigError) as raised:
    with config_errors.in_one_line(argv):
      pyconfig.initialize(argv)
  error = raised.value
  assert "\n" not in str(error) and len(str(error)) < 300, str(error)
  assert error.__cause__ is not None  # The original, for --verbosity.
  return error


def test_an_unknown_key_is_named_in_one_line(tmp_path, rng):
  key = f"no_such_key_{rng.integers(1 << 20)}"
  error = _read_config(_argv(tmp_path, f"{key}=1"))
  assert error.key == key
  assert str(error) == f"{key}: not a MaxText config key"


def test_a_misspelt_key_gets_the_valid_one_it_is_close_to(tmp_path):
  error = _read_config(_argv(tmp_path, "base_emb_dimm=256"))
  assert error.key == "base_emb_dimm"
  assert "did you mean base_emb_dim" in str(error)


def test_a_batch_size_that_is_not_a_number_is_named_with_its_value(tmp_path,
                                                                   rng):
  value = "".join(rng.choice(list("abcdefgh"), size=5))
  error = _read_config(_argv(tmp_path, f"per_device_batch_size={value}"))
  assert error.key == "per_device_batch_size"
  assert str(error).startswith(f"per_device_batch_size={value!r}: Input "
                               "should be a valid integer")


def test_a_mesh_the_devices_cannot_make_names_its_keys(tmp_path, rng):
  ways = int(rng.choice([3, 5, 6, 7]))  # None divides the 8 devices.
  error = _read_config(_argv(tmp_path, f"ici_tensor_parallelism={ways}"))
  assert error.key == f"ici_tensor_parallelism={ways}"
  assert str(error).endswith("(8 devices)")


def test_a_missing_config_file_is_named(tmp_path):
  missing = str(tmp_path / "no_such_base.yml")
  error = _read_config(_argv(tmp_path, config_file=missing))
  assert error.key == "config file"
  assert missing in str(error) and "No such file" in str(error)


def test_a_valid_config_reads_as_before_and_initialize_is_restored(
    tmp_path):
  from maxtext.configs import pyconfig  # pylint: disable=g-import-not-at-top
  initialize = pyconfig.initialize
  argv = _argv(tmp_path, "ici_tensor_parallelism=4")
  with config_errors.in_one_line(argv):
    config = pyconfig.initialize(argv)
  assert config.ici_tensor_parallelism == 4
  assert pyconfig.initialize is initialize


def _launch(tmp_path, *extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8",
             TF_CPP_MIN_LOG_LEVEL="2")
  return subprocess.run([sys.executable, "-m", _MODULE,
                         *_argv(tmp_path, *extra)[1:]], capture_output=True,
                        text=True, timeout=300, env=env, cwd=tmp_path)


def test_the_launcher_prints_one_line_and_exits_2(tmp_path):
  run = _launch(tmp_path, "no_such_key=1")
  assert run.returncode == 2, run.stderr[-3000:]
  assert "Traceback" not in run.stderr
  (line,) = [l for l in run.stderr.splitlines() if "config error" in l]
  assert line == (f"python -m {_MODULE}: MaxText config error: no_such_key: "
                  "not a MaxText config key (--verbosity=0 shows MaxText's "
                  "traceback)")
  assert "'emb_dim'" not in run.stderr  # Not every valid key.


def test_the_launcher_keeps_the_traceback_under_verbosity(tmp_path):
  run = _launch(tmp_path, "no_such_key=1", "--verbosity=0")
  assert run.returncode != 0
  assert "Traceback" in run.stderr and "no_such_key" in run.stderr
