"""The parameter tree does not depend on --use_collective_matmul, with the
fused projections (fused_mlp, fused_qkv) off or on."""
import re

import jax
import numpy as np
import pytest

import collective_matmul as cm
from reference_host import ab as ab_lib
from reference_host import config as config_lib
from reference_host import trainer as trainer_lib

from host_test_utils import BASE_CONFIG, TEST_MODEL_ARGS

OFF = cm.CollectiveMatmulConfig(enabled=False)
ON = cm.CollectiveMatmulConfig(enabled=True, impl="ring")


FUSED = ("fused_mlp=True", "fused_qkv=True")
fused_or_not = pytest.mark.parametrize("fused", [(), FUSED],
                                       ids=["unfused", "fused"])


def _config(rng, tensor, fused=()):
  return config_lib.load_config(
      [BASE_CONFIG, *TEST_MODEL_ARGS,
       f"ici_tensor_sequence_parallelism={tensor}",
       f"init_weights_seed={int(rng.integers(1 << 30))}", *fused])


def _flat(tree):
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@fused_or_not
@pytest.mark.parametrize("tensor", [2, 4])
def test_parameter_names_shapes_dtypes_and_shardings_match(rng, tensor, fused):
  config = _config(rng, tensor, fused)
  off = _flat(trainer_lib.Trainer(config, OFF).abstract_state)
  on = _flat(trainer_lib.Trainer(config, ON).abstract_state)
  assert off.keys() == on.keys()
  for name in off:
    assert off[name].shape == on[name].shape, name
    assert off[name].dtype == on[name].dtype, name
    assert off[name].sharding.spec == on[name].sharding.spec, name


@fused_or_not
def test_logical_partitioning_matches(rng, fused):
  config = _config(rng, 4, fused)
  off = _flat(trainer_lib.Trainer(config, OFF).logical_param_specs())
  on = _flat(trainer_lib.Trainer(config, ON).logical_param_specs())
  assert off == on
  # "['layers_0']['mlp']['wi']['kernel']" -> "wi"
  specs = {re.findall(r"'([^']+)'", name)[-2]: tuple(spec)
           for name, spec in off.items()
           if "layers_0" in name and "kernel" in name}
  # The input projections are the seed's rhs: output features over 'tensor'
  # (the fused layers: MaxText's names, one dim over 'tensor').
  if fused:
    assert specs["wi"] == ("embed", "num_activations", "mlp")
    assert specs["qkv_proj"] == ("embed", "kv_heads", "qkv", "kv")
    assert not {"wi_0", "wi_1", "query", "key", "value"} & specs.keys()
  else:
    assert specs["wi_0"] == specs["wi_1"] == ("embed", "mlp")
    assert not {"wi", "qkv_proj"} & specs.keys()


@fused_or_not
def test_initial_parameter_values_match(rng, fused):
  config = _config(rng, 2, fused)
  off = _flat(trainer_lib.Trainer(config, OFF).init_state()["params"])
  on = _flat(trainer_lib.Trainer(config, ON).init_state()["params"])
  assert off.keys() == on.keys()
  for name in off:
    np.testing.assert_array_equal(np.asarray(off[name]), np.asarray(on[name]),
                                  err_msg=name)


@fused_or_not
def test_collective_flag_rewrites_the_projections_and_keeps_the_loss(
    rng, fused):
  config = _config(rng, 4, fused)
  if fused:  # test_ab.py checks the unfused loss
    result = ab_lib.run_ab(config, ON, num_steps=2, log=None)
    assert result.losses_match, result.loss_diffs
    decisions = result.decisions
  else:
    trainer = trainer_lib.Trainer(config, ON)
    trainer.compile()
    decisions = trainer.decisions
  by_name = {d.name: d for d in decisions}
  inputs = (("mlp/wi", "self_attention/qkv_proj") if fused else
            ("mlp/wi_0", "mlp/wi_1", "self_attention/query",
             "self_attention/key", "self_attention/value"))
  for layer in inputs:  # one gathered GEMM per (fused) projection
    decision = by_name[f"layers_0/{layer}"]
    assert decision.rewritten, decision
    # ici_tensor_sequence_parallelism sizes MaxText's own mesh axis.
    assert decision.axis == "tensor_sequence"
    assert decision.collective == "all_gather"
  for layer in ("mlp/wo", "self_attention/out"):
    decision = by_name[f"layers_0/{layer}"]
    assert decision.rewritten, decision
    assert decision.collective == "reduce_scatter"


def test_output_projections_can_be_left_to_xla(rng):
  config = _config(rng, 4, FUSED).replace(collective_output_projections=False)
  trainer = trainer_lib.Trainer(config, ON)
  trainer.compile()
  by_name = {d.name: d for d in trainer.decisions}
  assert by_name["layers_0/mlp/wi"].rewritten
  for layer in ("mlp/wo", "self_attention/out"):
    assert not by_name[f"layers_0/{layer}"].rewritten
