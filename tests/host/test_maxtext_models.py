"""MaxText's own model files (maxtext 0.2.5's configs/models/, copied
unchanged into data/maxtext_models/) load with the host's base, their
logical_axis_rules merged into the host's as MaxText merges them, and a
shrunk copy of each trains."""
import os
import re

import numpy as np
import pytest
import yaml

import collective_matmul as cm
from reference_host import config as config_lib
from reference_host import trainer as trainer_lib

from host_test_utils import BASE_CONFIG, DATA_DIR

MAXTEXT_MODELS = os.path.join(DATA_DIR, "maxtext_models")
MODEL_NAMES = ("llama2-7b", "mistral-7b", "llama3-8b")
ON = cm.CollectiveMatmulConfig(enabled=True, impl="ring")


def _yaml(path):
  with open(path) as f:
    return yaml.safe_load(f)


def _model_file(name):
  return _yaml(os.path.join(MAXTEXT_MODELS, f"{name}.yml"))


def _base_rules():
  return _yaml(BASE_CONFIG)["logical_axis_rules"]


def _load(*args, model_dir=MAXTEXT_MODELS, num_devices=None):
  return config_lib.load_config([BASE_CONFIG, *args], model_dir=model_dir,
                                num_devices=num_devices)


def _shrunk(name):
  """Overrides that keep the file's model (its query heads per kv head, its
  rules) at a size that trains in seconds on CPU; every sharded dim divides
  a tensor axis of 4."""
  model = _model_file(name)
  group = model["base_num_query_heads"] // model["base_num_kv_heads"]
  heads = 16
  return (f"model_name={name}", "base_emb_dim=64",
          f"base_num_query_heads={heads}",
          f"base_num_kv_heads={heads // group}",
          "head_dim=16", "base_mlp_dim=256", "base_num_decoder_layers=1",
          "vocab_size=256", "max_target_length=32", "dtype=float32",
          "enable_checkpointing=False")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_maxtext_model_file_loads_unchanged(name):
  model = _model_file(name)
  config = _load(f"model_name={name}")
  for key, value in model.items():
    if key != "logical_axis_rules":
      assert config[key] == value, key
  # Each of the file's rules replaces the base rules of its logical name; the
  # other base rules keep their order, ahead of the file's.
  file_rules = model.get("logical_axis_rules", [])
  names = {rule[0] for rule in file_rules}
  assert config.logical_axis_rules == (
      [rule for rule in _base_rules() if rule[0] not in names] + file_rules)


def test_llama2_rule_names_fsdp_and_replaces_the_base_norm_rule():
  # The line that the host used to reject.
  assert _model_file("llama2-7b")["logical_axis_rules"] == [["norm", "fsdp"]]
  config = _load("model_name=llama2-7b")
  norm_rules = [rule for rule in config.logical_axis_rules
                if rule[0] == "norm"]
  assert norm_rules == [["norm", "fsdp"]]


def test_command_line_rules_merge_after_the_model_files():
  config = _load("model_name=llama2-7b",
                 "logical_axis_rules=[['norm', 'tensor'], ['kv', null]]")
  rules = config.logical_axis_rules
  assert [rule for rule in rules if rule[0] in ("norm", "kv")] == [
      ["norm", "tensor"], ["kv", None]]
  assert rules[-2:] == [["norm", "tensor"], ["kv", None]]
  assert len(rules) == len(_base_rules())


def test_override_logical_axis_rules_replaces_the_whole_list(tmp_path):
  rules = [["activation_batch", "data"], ["mlp", "tensor"]]
  (tmp_path / "custom.yml").write_text(
      "base_emb_dim: 64\noverride_logical_axis_rules: True\n"
      f"logical_axis_rules: {rules}\n")
  config = _load("model_name=custom", model_dir=str(tmp_path))
  assert config.logical_axis_rules == rules


@pytest.mark.parametrize("axis", config_lib.MESH_AXES)
def test_a_rule_may_name_any_maxtext_mesh_axis(axis):
  config = _load("model_name=llama2-7b", f"logical_axis_rules=[['norm', "
                 f"['{axis}']]]")
  assert ["norm", [axis]] in config.logical_axis_rules


def test_rule_naming_an_unknown_mesh_axis_is_an_error_naming_rule_and_axes(
    tmp_path, rng):
  axis = f"fsdp_{rng.integers(1_000_000)}"
  path = tmp_path / "custom.yml"
  path.write_text(f"logical_axis_rules: [['norm', '{axis}']]\n")
  with pytest.raises(config_lib.ConfigError) as error:
    _load("model_name=custom", model_dir=str(tmp_path))
  message = str(error.value)
  assert f"['norm', '{axis}']" in message
  assert str(path) in message  # the file it came from
  assert str(list(config_lib.MESH_AXES)) in message
  with pytest.raises(config_lib.ConfigError,
                     match=re.escape(f"mesh axis '{axis}'")):
    _load("model_name=llama2-7b", f"logical_axis_rules=[['mlp', ['tensor', "
          f"'{axis}']]]")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_shrunk_maxtext_model_trains_sequence_parallel(name):
  config = _load(*_shrunk(name), "ici_data_parallelism=2",
                 "ici_tensor_sequence_parallelism=4", "steps=2")
  trainer = trainer_lib.Trainer(config, ON)
  result = trainer.train(trainer.init_state(), log=None)
  assert len(result.losses) == 2
  assert np.all(np.isfinite(result.losses)), result.losses
  rewritten = {d.name for d in result.decisions if d.rewritten}
  assert "layers_0/mlp/wi_0" in rewritten, result.decisions


def test_llama2_norm_rule_shards_the_norm_scales_over_fsdp():
  config = _load(*_shrunk("llama2-7b"), "ici_fsdp_parallelism=2",
                 "ici_tensor_sequence_parallelism=2")
  trainer = trainer_lib.Trainer(config, cm.CollectiveMatmulConfig(
      enabled=False))
  params = trainer.state_shardings["params"]
  assert tuple(params["decoder_norm"]["scale"].spec) == ("fsdp",)
  assert tuple(params["layers_0"]["mlp"]["wi_0"]["kernel"].spec) == (
      "fsdp", "tensor_sequence")
  assert trainer.mesh.shape["fsdp"] == 2
