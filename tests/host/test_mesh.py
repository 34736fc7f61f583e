"""The mesh over MaxText's axes: sizes from the ici_* keys, the same
shardings as the former ('data', 'tensor') mesh for the host's own rules, and
FSDP training the model as data parallelism does."""
import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

import collective_matmul as cm
from reference_host import ab as ab_lib
from reference_host import config as config_lib
from reference_host import mesh as mesh_lib
from reference_host import trainer as trainer_lib

from host_test_utils import BASE_CONFIG, TEST_MODEL_ARGS

OFF = cm.CollectiveMatmulConfig(enabled=False)
ON = cm.CollectiveMatmulConfig(enabled=True, impl="ring")

# base.yml's rules for the former ('data', 'tensor') mesh, whose 'tensor'
# axis had ici_tensor_parallelism x ici_tensor_sequence_parallelism devices.
FORMER_RULES = (
    ("activation_batch", "data"), ("activation_mlp", "tensor"),
    ("activation_heads", "tensor"), ("activation_kv_heads", "tensor"),
    ("activation_vocab", "tensor"), ("activation_length", "tensor"),
    ("activation_embed", None), ("activation_kv", None), ("mlp", "tensor"),
    ("heads", "tensor"), ("kv_heads", "tensor"), ("vocab", "tensor"),
    ("embed", None), ("num_activations", None), ("qkv", None), ("kv", None),
    ("norm", None))


def _load(*args, num_devices=8):
  return config_lib.load_config([BASE_CONFIG, *TEST_MODEL_ARGS, *args],
                                num_devices=num_devices)


def _flat(tree):
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_mesh_has_maxtext_axes_sized_by_their_keys():
  config = _load("ici_tensor_sequence_parallelism=4", "ici_data_parallelism=2")
  mesh = mesh_lib.create_mesh(config)
  assert mesh.axis_names == config_lib.MESH_AXES
  assert mesh.axis_types == (AxisType.Auto,) * len(config_lib.MESH_AXES)
  expected = {axis: 1 for axis in config_lib.MESH_AXES}
  expected.update(data=2, tensor_sequence=4)
  assert dict(mesh.shape) == expected


def test_maxtext_axis_order_and_key_names():
  # MaxText 0.2.5's mesh_axes in order, with older MaxText's 'sequence'.
  maxtext = ["diloco", "data", "stage", "fsdp", "fsdp_transpose", "context",
             "context_usp_ulysses", "context_autoregressive", "tensor",
             "tensor_sequence", "expert", "autoregressive"]
  assert [a for a in config_lib.MESH_AXES if a != "sequence"] == maxtext
  assert config_lib.MESH_AXIS_KEYS["stage"] == "ici_pipeline_parallelism"
  assert config_lib.MESH_AXIS_KEYS["sequence"] == "ici_sequence_parallelism"
  assert (config_lib.MESH_AXIS_KEYS["tensor_sequence"]
          == "ici_tensor_sequence_parallelism")


@pytest.mark.parametrize("keys, renamed", [
    (("ici_tensor_parallelism=4",), "tensor"),
    (("ici_tensor_parallelism=2", "ici_data_parallelism=4"), "tensor"),
    ((), "tensor"),
    (("ici_tensor_sequence_parallelism=4",), "tensor_sequence"),
], ids=["data2xtensor4", "data4xtensor2", "data8", "data2xtensor_sequence4"])
def test_host_rules_shard_as_the_former_data_tensor_mesh(keys, renamed):
  """Parameters and the batch get the specs the former mesh and rules gave
  them; with ici_tensor_sequence_parallelism the axis is MaxText's own."""
  trainer = trainer_lib.Trainer(_load(*keys, "fused_mlp=True"), OFF)
  logical = _flat(trainer.logical_param_specs())
  actual = _flat(trainer.state_shardings["params"])
  for name, logical_spec in logical.items():
    former = nn.logical_to_mesh_axes(tuple(logical_spec), FORMER_RULES)
    former = PartitionSpec(*[renamed if axis == "tensor" else axis
                             for axis in former])
    if trainer.config.tensor_parallelism == 1:  # 'tensor' was a size-1 axis
      former = PartitionSpec(*[None if axis == renamed else axis
                               for axis in former])
    assert actual[name].spec == former, name
  assert trainer.batch_sharding.spec == PartitionSpec("data", None)


def test_tensor_and_tensor_sequence_together_shard_over_both():
  trainer = trainer_lib.Trainer(
      _load("ici_tensor_parallelism=2", "ici_tensor_sequence_parallelism=2"),
      OFF)
  kernel = trainer.state_shardings["params"]["layers_0"]["mlp"]["wi_0"][
      "kernel"]
  assert kernel.spec == PartitionSpec(None, ("tensor", "tensor_sequence"))
  assert trainer.config.tensor_parallelism == 4


@pytest.mark.parametrize("fsdp_keys, data_keys, num_devices, plugin", [
    (("ici_fsdp_parallelism=2", "ici_data_parallelism=1"),
     ("ici_data_parallelism=2",), 2, OFF),
    (("ici_fsdp_parallelism=2", "ici_data_parallelism=2",
      "ici_tensor_sequence_parallelism=2"),
     ("ici_data_parallelism=4", "ici_tensor_sequence_parallelism=2"), 8, ON),
], ids=["fsdp2-vs-data2", "fsdp2xdata2xtsp2-vs-data4xtsp2-plugin-on"])
def test_fsdp_trains_with_the_loss_of_data_parallelism(
    rng, fsdp_keys, data_keys, num_devices, plugin):
  devices = jax.devices()[:num_devices]
  seed = f"init_weights_seed={int(rng.integers(1 << 30))}"
  losses = {}
  for arm, keys in (("fsdp", fsdp_keys), ("data", data_keys)):
    config = _load(*keys, seed, "steps=3", num_devices=num_devices)
    trainer = trainer_lib.Trainer(config, plugin, devices=devices)
    if arm == "fsdp":
      # FSDP: the batch over data x fsdp, the weights' embed dim over fsdp.
      assert "fsdp" in jax.tree.leaves(tuple(trainer.batch_sharding.spec))
      kernel = trainer.state_shardings["params"]["layers_0"]["mlp"]["wi_0"][
          "kernel"]
      assert kernel.spec[0] == "fsdp"
    losses[arm] = trainer.train(trainer.init_state(), log=None).losses
  np.testing.assert_allclose(
      losses["fsdp"], losses["data"],
      rtol=ab_lib.DEFAULT_RELATIVE_LOSS_TOLERANCE["float32"])


@pytest.mark.parametrize("args, key", [
    (("ici_context_parallelism=2",), "ici_context_parallelism"),
    (("ici_pipeline_parallelism=2",), "ici_pipeline_parallelism"),
    (("ici_diloco_parallelism=2",), "ici_diloco_parallelism"),
    (("ici_fsdp_parallelism=-1",), "ici_fsdp_parallelism"),
    (("ici_expert_parallelism=0",), "ici_expert_parallelism"),
    (("ici_fsdp_parallelism=3",), "ici_fsdp_parallelism"),
    (("ici_fsdp_parallelism=8", "per_device_batch_size=0.5"),
     "per_device_batch_size"),
], ids=["unused-axis", "pipeline", "diloco", "fsdp-fill", "size-0",
        "fsdp-not-dividing-embed", "batch-not-dividing-fsdp"])
def test_bad_mesh_key_is_an_error_naming_it(args, key):
  with pytest.raises(config_lib.ConfigError, match=key):
    _load(*args)


def test_an_axis_named_by_a_rule_may_be_larger_than_one():
  config = _load("ici_context_parallelism=2",
                 "logical_axis_rules=[['activation_length', ['tensor', "
                 "'tensor_sequence', 'context']]]")
  assert config.mesh_axis_sizes["context"] == 2
  assert config.data_parallelism == 4
