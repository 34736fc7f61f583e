"""Config loading: base + model overlay + overrides, and errors naming keys."""
import os

import pytest
import yaml

from reference_host import config as config_lib

from host_test_utils import BASE_CONFIG, DATA_DIR

MODEL_DIR = os.path.dirname(BASE_CONFIG)


def _yaml(path):
  with open(path) as f:
    return yaml.safe_load(f)


def test_model_file_overrides_base_and_leaves_other_keys():
  base = _yaml(BASE_CONFIG)
  model = _yaml(os.path.join(MODEL_DIR, "llama3-8b.yml"))
  config = config_lib.load_config([BASE_CONFIG, "model_name=llama3-8b"])
  for key, value in model.items():
    assert config[key] == value, key
  untouched = set(base) - set(model) - {"model_name"}
  for key in untouched:
    assert config[key] == base[key], key


def test_command_line_override_wins_over_model_file(rng):
  steps = int(rng.integers(1, 10_000))
  heads = int(rng.choice([4, 8, 16]))
  config = config_lib.load_config(
      [BASE_CONFIG, "model_name=tiny", f"steps={steps}",
       f"base_num_kv_heads={heads}", f"base_num_query_heads={2 * heads}"])
  assert config.steps == steps
  assert config.num_kv_heads == heads
  assert config.num_query_heads == 2 * heads


def test_override_value_keeps_yaml_type(rng):
  rate = float(rng.uniform(1e-5, 1e-2))
  config = config_lib.load_config(
      [BASE_CONFIG, f"learning_rate={rate!r}", "logits_via_embedding=true",
       'mlp_activations=["silu","linear"]'])
  assert config.learning_rate == rate
  assert config.logits_via_embedding is True
  assert config.mlp_activations == ["silu", "linear"]


def test_unknown_override_key_is_an_error_naming_it(rng):
  key = f"not_a_key_{rng.integers(1_000_000)}"
  with pytest.raises(config_lib.ConfigError, match=key):
    config_lib.load_config([BASE_CONFIG, f"{key}=1"])


def test_unknown_key_in_model_file_is_an_error_naming_it(tmp_path, rng):
  key = f"made_up_{rng.integers(1_000_000)}"
  (tmp_path / "custom.yml").write_text(f"base_emb_dim: 64\n{key}: 3\n")
  with pytest.raises(config_lib.ConfigError, match=key):
    config_lib.load_config([BASE_CONFIG, "model_name=custom"],
                           model_dir=str(tmp_path))


def test_value_of_wrong_type_is_an_error_naming_the_key():
  with pytest.raises(config_lib.ConfigError, match="steps"):
    config_lib.load_config([BASE_CONFIG, "steps=many"])


def test_unknown_model_name_is_an_error_naming_the_key(rng):
  name = f"llama-{rng.integers(1_000_000)}b"
  with pytest.raises(config_lib.ConfigError, match=f"model_name={name!r}"):
    config_lib.load_config([BASE_CONFIG, f"model_name={name}"])


def test_missing_config_file_is_an_error_naming_it(tmp_path):
  missing = str(tmp_path / "nowhere.yml")
  with pytest.raises(config_lib.ConfigError, match="nowhere.yml"):
    config_lib.load_config([missing])


@pytest.mark.parametrize("data, tensor", [(3, 2), (2, 3), (4, 4)])
def test_mesh_not_matching_devices_is_an_error_naming_the_key(data, tensor):
  with pytest.raises(config_lib.ConfigError, match="ici_"):
    config_lib.load_config(
        [BASE_CONFIG, "model_name=tiny", f"ici_data_parallelism={data}",
         f"ici_tensor_parallelism={tensor}"], num_devices=8)


def test_tensor_axis_not_dividing_devices_is_an_error_naming_the_key():
  with pytest.raises(config_lib.ConfigError,
                     match="ici_tensor_sequence_parallelism"):
    config_lib.load_config(
        [BASE_CONFIG, "model_name=tiny",
         "ici_tensor_sequence_parallelism=3"], num_devices=8)


def test_batch_not_divisible_by_data_axis_is_an_error_naming_the_key():
  # 0.5 per device x 8 devices = 4 sequences over a data axis of 8.
  with pytest.raises(config_lib.ConfigError, match="per_device_batch_size"):
    config_lib.load_config(
        [BASE_CONFIG, "model_name=tiny", "per_device_batch_size=0.5",
         "ici_data_parallelism=8"], num_devices=8)


def test_fractional_batch_that_divides_is_accepted():
  config = config_lib.load_config(
      [BASE_CONFIG, "model_name=tiny", "per_device_batch_size=0.5",
       "ici_tensor_sequence_parallelism=2"], num_devices=8)
  assert config.global_batch_size == 4
  assert config.data_parallelism == 4


def test_sequence_not_divisible_by_tensor_axis_is_an_error_naming_the_key(rng):
  length = 4 * int(rng.integers(1, 64)) + 2
  with pytest.raises(config_lib.ConfigError, match="max_target_length"):
    config_lib.load_config(
        [BASE_CONFIG, "model_name=tiny", f"max_target_length={length}",
         "ici_tensor_sequence_parallelism=4"])


def test_tensor_axis_size_is_product_of_tensor_keys(rng):
  tp, tsp = (int(v) for v in rng.choice([1, 2], size=2))
  config = config_lib.load_config(
      [BASE_CONFIG, "model_name=tiny", f"ici_tensor_parallelism={tp}",
       f"ici_tensor_sequence_parallelism={tsp}"], num_devices=8)
  assert config.tensor_parallelism == tp * tsp
  assert config.data_parallelism == 8 // (tp * tsp)


def test_maxtext_model_file_loads_verbatim():
  # mistral-7b.yml uses the older spelling rms_norm_epsilon and tokenizer
  # keys; both must load.
  maxtext = _yaml(os.path.join(DATA_DIR, "maxtext_mistral-7b.yml"))
  config = config_lib.load_config(
      [BASE_CONFIG, "model_name=maxtext_mistral-7b"], model_dir=DATA_DIR)
  assert config.normalization_layer_epsilon == maxtext["rms_norm_epsilon"]
  assert config.decoder_block == maxtext["decoder_block"]
  assert config.num_kv_heads == maxtext["base_num_kv_heads"]


@pytest.mark.parametrize("name", ["llama3-8b", "mistral-7b"])
def test_our_model_file_agrees_with_maxtext_on_model_keys(name):
  ours = config_lib.load_config([BASE_CONFIG, f"model_name={name}"])
  theirs = config_lib.load_config(
      [BASE_CONFIG, f"model_name=maxtext_{name}"], model_dir=DATA_DIR)
  for key in ("emb_dim", "num_query_heads", "num_kv_heads", "mlp_dim",
              "num_decoder_layers", "head_dim", "vocab_size",
              "normalization_layer_epsilon", "rope_max_timescale",
              "mlp_activations", "logits_via_embedding"):
    assert getattr(ours, key) == getattr(theirs, key), key


def test_maxtext_model_of_another_architecture_is_reported_by_key():
  with pytest.raises(config_lib.ConfigError, match="decoder_block='qwen3'"):
    config_lib.load_config([BASE_CONFIG, "model_name=maxtext_qwen3-8b"],
                           model_dir=DATA_DIR)


def test_unsupported_feature_value_is_an_error_naming_the_key():
  with pytest.raises(config_lib.ConfigError, match="num_experts"):
    config_lib.load_config([BASE_CONFIG, "model_name=tiny", "num_experts=8"])


# ----------------------------------------------- first-hour errors (issue 15)


def test_a_model_file_given_as_the_base_says_how_to_choose_it():
  with pytest.raises(config_lib.ConfigError,
                     match=r"not a base config.*base\.yml model_name=tiny "
                           r"steps=5"):
    config_lib.load_config([os.path.join(MODEL_DIR, "tiny.yml"), "steps=5"])


def test_an_unknown_key_suggests_the_close_ones():
  with pytest.raises(config_lib.ConfigError, match="stepz: did you mean steps"):
    config_lib.load_config([BASE_CONFIG, "stepz=5"])


def test_a_number_yaml_reads_as_a_string_is_converted_by_the_default_type():
  config = config_lib.load_config([BASE_CONFIG, "learning_rate=1e-3"])
  assert config.learning_rate == pytest.approx(1e-3)
  assert isinstance(config.learning_rate, float)
  with pytest.raises(config_lib.ConfigError, match="learning_rate='fast'"):
    config_lib.load_config([BASE_CONFIG, "learning_rate=fast"])


def test_a_mesh_that_does_not_fit_the_devices_is_blamed_first():
  with pytest.raises(config_lib.ConfigError,
                     match="ici_tensor_sequence_parallelism=3.*8 devices"):
    config_lib.load_config([BASE_CONFIG, "model_name=tiny",
                            "ici_tensor_sequence_parallelism=3"],
                           num_devices=8)


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
  bad = tmp_path / "base.yml"
  bad.write_text("steps: 5\nlogical_axis_rules: [[1,\nrun_name: x\n")
  with pytest.raises(config_lib.ConfigError,
                     match=r"base\.yml is not valid YAML at line \d+"):
    config_lib.load_config([str(bad)])
