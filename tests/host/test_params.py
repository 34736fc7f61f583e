"""The parameter tree does not depend on --use_collective_matmul."""
import jax
import numpy as np
import pytest

import collective_matmul as cm
from reference_host import config as config_lib
from reference_host import trainer as trainer_lib

from host_test_utils import BASE_CONFIG, TEST_MODEL_ARGS

OFF = cm.CollectiveMatmulConfig(enabled=False)
ON = cm.CollectiveMatmulConfig(enabled=True, impl="ring")


def _config(rng, tensor):
  return config_lib.load_config(
      [BASE_CONFIG, *TEST_MODEL_ARGS,
       f"ici_tensor_sequence_parallelism={tensor}",
       f"init_weights_seed={int(rng.integers(1 << 30))}"])


def _flat(tree):
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("tensor", [2, 4])
def test_parameter_names_shapes_dtypes_and_shardings_match(rng, tensor):
  config = _config(rng, tensor)
  off = _flat(trainer_lib.Trainer(config, OFF).abstract_state)
  on = _flat(trainer_lib.Trainer(config, ON).abstract_state)
  assert off.keys() == on.keys()
  for name in off:
    assert off[name].shape == on[name].shape, name
    assert off[name].dtype == on[name].dtype, name
    assert off[name].sharding.spec == on[name].sharding.spec, name


def test_logical_partitioning_matches(rng):
  config = _config(rng, 4)
  off = _flat(trainer_lib.Trainer(config, OFF).logical_param_specs())
  on = _flat(trainer_lib.Trainer(config, ON).logical_param_specs())
  assert off == on
  # The MLP input kernels are the seed's rhs: output features over 'tensor'.
  wi_0 = next(spec for name, spec in off.items() if "wi_0" in name)
  assert tuple(wi_0) == ("embed", "mlp")


def test_initial_parameter_values_match(rng):
  config = _config(rng, 2)
  off = _flat(trainer_lib.Trainer(config, OFF).init_state()["params"])
  on = _flat(trainer_lib.Trainer(config, ON).init_state()["params"])
  for name in off:
    np.testing.assert_array_equal(np.asarray(off[name]), np.asarray(on[name]),
                                  err_msg=name)


def test_collective_flag_rewrites_the_mlp_input_projections(rng):
  trainer = trainer_lib.Trainer(_config(rng, 4), ON)
  trainer.compile()
  by_name = {d.name: d for d in trainer.decisions}
  for layer in ("wi_0", "wi_1"):
    decision = by_name[f"layers_0/mlp/{layer}"]
    assert decision.rewritten, decision
    assert decision.axis == "tensor"
