"""Config values are checked before anything runs (issue 33, items 8 and 9):
ranges, non-finite numbers, keys the host does not implement, names that
must not be paths, files that are not YAML text, and a model too large for
the machine. Each error is one ConfigError naming the key and where its
value came from."""
import os

import pytest

from reference_host import config as config_lib
from reference_host import model as model_lib

from host_test_utils import BASE_CONFIG

MODEL_DIR = os.path.dirname(BASE_CONFIG)


def _load(*args, num_devices=None):
  return config_lib.load_config([BASE_CONFIG, "model_name=tiny", *args],
                                num_devices=num_devices)


def _error(*args, **kwargs) -> str:
  with pytest.raises(config_lib.ConfigError) as info:
    _load(*args, **kwargs)
  message = str(info.value)
  assert "\n" not in message, message
  return message


@pytest.mark.parametrize("override, says", [
    ("learning_rate=-1", "must be > 0"),
    ("learning_rate=0", "must be > 0"),
    ("adam_b1=2.0", "must be in [0, 1)"),
    ("adam_b1=-0.1", "must be in [0, 1)"),
    ("adam_b2=1.0", "must be in [0, 1)"),
    ("warmup_steps=-5", "must be >= 0"),
    ("dropout_rate=5", "must be in [0, 1)"),
    ("gradient_clipping_threshold=-1", "must be >= 0"),
    ("adam_eps=-1e-8", "must be >= 0"),
    ("adam_weight_decay=-0.1", "must be >= 0"),
    ("normalization_layer_epsilon=0", "must be > 0"),
    ("data_shuffle_seed=-1", "must be a seed"),
    ("init_weights_seed=-1", "must be a seed"),
    ("init_weights_seed=9223372036854775808", "must be a seed"),
])
def test_a_value_out_of_range_is_refused_naming_key_and_source(override,
                                                                 says):
  key = override.partition("=")[0]
  message = _error(override)
  assert message.startswith(f"{key}="), message
  assert "(from command-line overrides)" in message
  assert says in message


@pytest.mark.parametrize("override", [
    "gradient_clipping_threshold=nan", "gradient_clipping_threshold=.nan",
    "gradient_clipping_threshold=inf", "learning_rate=nan",
    "adam_b1=.nan", "adam_eps=inf", "normalization_layer_epsilon=nan"])
def test_a_non_finite_number_is_refused(override):
  """nan must not turn clipping off (`nan > 0` is False in the trainer)."""
  key = override.partition("=")[0]
  message = _error(override)
  assert message.startswith(f"{key}="), message
  assert "must be a finite number" in message


def test_the_source_named_is_the_file_that_set_the_value(tmp_path):
  model = tmp_path / "bad.yml"
  model.write_text("learning_rate: -0.5\n")
  base = tmp_path / "base.yml"
  base.write_text(open(BASE_CONFIG).read())
  with pytest.raises(config_lib.ConfigError,
                     match=r"learning_rate=-0\.5 \(from .*bad\.yml\) must be "
                           r"> 0"):
    config_lib.load_config([str(base), "model_name=bad"])


@pytest.mark.parametrize("override, key", [
    ("enable_dropout=True", "enable_dropout"),
    ("dropout_rate=0.1", "dropout_rate"),
])
def test_a_key_the_host_does_not_implement_is_refused(override, key):
  """Dropout is accepted by MaxText's keys but not read by this host's
  model: any value other than "off" is refused, not ignored."""
  message = _error(override)
  assert message.startswith(f"{key}=")
  assert "reference host does not implement dropout" in message


def test_dropout_keys_off_load_as_in_maxtext_model_files():
  config = _load("enable_dropout=False", "dropout_rate=0.0")
  assert config.enable_dropout is False and config.dropout_rate == 0.0


@pytest.mark.parametrize("override", [
    "enable_dropout=1", "enable_dropout='false'", "fused_mlp=yes please",
    "steps=2.5", "steps=true", "log_period=1.0", "vocab_size=1e9",
    "learning_rate=true"])
def test_booleans_are_booleans_and_ints_are_ints(override):
  key = override.partition("=")[0]
  message = _error(override)
  assert message.startswith(f"{key}=")
  assert "has type" in message


@pytest.mark.parametrize("run_name", [
    "../escape", "a/b", "/tmp/elsewhere", "..", ".", "runs/../../x"])
def test_run_name_is_a_name_not_a_path(run_name):
  message = _error(f"run_name={run_name}")
  assert message.startswith(f"run_name={run_name!r}")
  assert "must be a name, not a path" in message


def test_run_name_from_a_file_is_checked_too(tmp_path):
  base = tmp_path / "base.yml"
  base.write_text(open(BASE_CONFIG).read().replace(
      'run_name: ""', 'run_name: "../up"'))
  with pytest.raises(config_lib.ConfigError,
                     match=r"run_name='\.\./up' \(from .*base\.yml\) must be "
                           "a name"):
    config_lib.load_config([str(base)])


def test_a_plain_run_name_and_the_empty_default_load():
  assert _load("run_name=my-run_2.v1").run_name == "my-run_2.v1"
  assert _load().run_name == ""


@pytest.mark.parametrize("model_name", [
    "../model_configs/tiny", os.path.join(MODEL_DIR, "tiny"), "sub/tiny",
    ".."])
def test_model_name_names_a_model_file_not_a_path(model_name):
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.load_config([BASE_CONFIG, f"model_name={model_name}"])
  message = str(info.value)
  assert message.startswith(f"model_name={model_name!r}")
  assert "not a path" in message
  assert "first argument" in message  # Where a path goes instead.


def test_model_name_of_another_type_is_refused():
  with pytest.raises(config_lib.ConfigError, match="model_name=5 .* must be "
                     "the name of a model file"):
    config_lib.load_config([BASE_CONFIG, "model_name=5"])


def test_a_binary_base_file_is_one_config_error(tmp_path):
  binary = tmp_path / "weights.yml"
  binary.write_bytes(b"steps: 1\n" + bytes(range(128, 256)) * 4)
  with pytest.raises(config_lib.ConfigError,
                     match="is not a YAML text file") as info:
    config_lib.load_config([str(binary)])
  assert str(binary) in str(info.value)


def test_a_base_file_with_nul_bytes_is_one_config_error(tmp_path):
  binary = tmp_path / "nul.yml"
  binary.write_bytes(b"steps: 1\n\x00\x00\x00")
  with pytest.raises(config_lib.ConfigError, match="NUL bytes"):
    config_lib.load_config([str(binary)])


def test_a_model_file_with_a_non_name_key_is_one_config_error(tmp_path):
  base = tmp_path / "base.yml"
  base.write_text(open(BASE_CONFIG).read())
  (tmp_path / "odd.yml").write_text("1: 2\n")
  with pytest.raises(config_lib.ConfigError, match="has key 1, not a name"):
    config_lib.load_config([str(base), "model_name=odd"])


# --- The memory estimate ------------------------------------------------------

def test_the_memory_estimate_counts_state_and_activations():
  config = _load(num_devices=8)
  params = model_lib.count_params(config)
  estimate = config_lib.estimate_memory_bytes(config, params)
  assert estimate["state"] == 4 * params * 4  # float32 weights, Adam
  tokens = config.global_batch_size * config.max_target_length
  assert estimate["activations"] >= tokens * config.vocab_size * 4
  assert estimate["total"] == estimate["state"] + estimate["activations"]


@pytest.mark.parametrize("override", [
    "base_emb_dim=1048576", "vocab_size=1000000000"])
def test_a_model_beyond_the_memory_is_refused_in_one_line(override):
  config = _load(override, num_devices=8)
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.check_fits_memory(config, model_lib.count_params(config),
                                 16 * 2**30, "the 16.0 GiB of a test machine")
  message = str(info.value)
  assert "\n" not in message
  assert message.startswith("the model does not fit: it needs at least")
  assert "more than the 16.0 GiB of a test machine" in message
  assert override in message


def test_a_model_that_fits_is_not_refused():
  config = _load(num_devices=8)
  config_lib.check_fits_memory(config, model_lib.count_params(config),
                               2**30, "1 GiB")


def test_the_estimate_is_a_lower_bound_of_a_real_7b_run():
  """llama2-7b in float32 with Adam needs > 100 GiB: refused for a 64 GiB
  machine, accepted for 8 H200s."""
  config = config_lib.load_config(
      [BASE_CONFIG, "model_name=llama2-7b", "per_device_batch_size=1",
       "max_target_length=2048"], num_devices=8)
  params = model_lib.count_params(config)
  assert 6e9 < params < 7e9
  assert config_lib.estimate_memory_bytes(config, params)["total"] > (
      100 * 2**30)
  with pytest.raises(config_lib.ConfigError):
    config_lib.check_fits_memory(config, params, 64 * 2**30, "64 GiB")
  config_lib.check_fits_memory(config, params, 8 * 139 * 2**30, "8 H200s")
