"""Detection of the reduce-scatter pattern: pure matcher and the drop-in
`dot_general` in Explicit and logical modes."""
import flax.linen as nn
import jax
from jax import lax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

import collective_matmul as cm
from collective_matmul import patterns
import cm_test_utils as utils

DENSE = (((2,), (0,)), ((), ()))  # x[B, S, F] . w[F, E]
SIZES = {"data": 2, "tensor": 4}
T, D = ("tensor",), ("data",)


def _match(lhs_spec, rhs_spec, out_spec, lhs_shape=(8, 16, 32),
           rhs_shape=(32, 8), dimension_numbers=DENSE):
  return patterns.match_matmul_reduce_scatter(
      lhs_shape, rhs_shape, dimension_numbers, lhs_spec, rhs_spec, SIZES,
      out_spec)


def test_matches_sequence_scatter_of_the_output_projection():
  match = _match((D, (), T), (T, ()), (D, T, ()))
  assert isinstance(match, patterns.ReduceScatterMatch), match
  assert (match.axis, match.axis_size) == ("tensor", 4)
  assert (match.lhs_contract_dim, match.rhs_contract_dim) == (2, 0)
  assert (match.lhs_scatter_dim, match.out_scatter_dim) == (1, 1)
  assert match.out_spec == (D, T, ())


def test_matches_batch_scatter_with_tensor_minor():
  match = _match((D, (), T), (T, ()), (("data", "tensor"), (), ()))
  assert isinstance(match, patterns.ReduceScatterMatch), match
  assert match.out_scatter_dim == 0


def test_matches_transposed_rhs():
  match = _match(((), (), T), ((), T), ((), T, ()), rhs_shape=(8, 32),
                 dimension_numbers=(((2,), (1,)), ((), ())))
  assert isinstance(match, patterns.ReduceScatterMatch), match
  assert match.rhs_contract_dim == 1


@pytest.mark.parametrize("lhs,rhs,out,reason,fallback", [
    ((D, (), T), (T, ()), None, "result's sharding is not known", False),
    ((D, (), T), (T, ()), (D, (), ()), "replicated (all-reduced)", False),
    ((D, (), ()), ((), T), (D, (), T), "no mesh axis shards the contract",
     False),
    ((D, (), T), ((), ()), (D, T, ()), "no mesh axis shards the contract",
     False),
    (((), (), T), (T, D), ((), (), ("data", "tensor")), "on its columns",
     False),
    (((), (), ("data", "tensor")), (("data", "tensor"), ()),
     ((), ("data", "tensor"), ()), "several mesh axes", True),
    ((D, (), T), (T, ()), (("tensor",), (), ()), "differs from the", True),
    ((D, (), T), (T, ()), (D, T, ()), "", None),
])
def test_negatives_say_why(lhs, rhs, out, reason, fallback):
  match = _match(lhs, rhs, out)
  if fallback is None:
    assert isinstance(match, patterns.ReduceScatterMatch)
    return
  assert isinstance(match, patterns.NoMatch), match
  assert reason in match.reason
  assert match.fallback == fallback


def test_rows_that_do_not_split_are_a_fallback():
  match = _match((D, (), T), (T, ()), (D, T, ()), lhs_shape=(8, 6, 32))
  assert isinstance(match, patterns.NoMatch)
  assert match.fallback and "does not split into the 4 row blocks" in (
      match.reason)


def test_batch_dimensions_are_not_the_pattern():
  match = _match(((), (), T), ((), T, ()), ((), (), ()), rhs_shape=(8, 32, 4),
                 dimension_numbers=(((2,), (1,)), ((0,), (0,))))
  assert isinstance(match, patterns.NoMatch) and not match.fallback


# The drop-in dot_general.

def _explicit_operands(rng, mesh):
  x = jax.device_put(rng.standard_normal((8, 16, 32)).astype(np.float32),
                     NamedSharding(mesh, P("data", None, "tensor")))
  w = jax.device_put(rng.standard_normal((32, 8)).astype(np.float32),
                     NamedSharding(mesh, P("tensor", None)))
  return x, w


@pytest.fixture
def explicit_mesh():
  mesh = utils.mesh(2, 4, AxisType.Explicit)
  with jax.set_mesh(mesh):
    yield mesh


def _only_decision():
  (decision,) = cm.decisions()
  return decision


def test_explicit_out_sharding_on_rows_is_rewritten(rng, explicit_mesh):
  x, w = _explicit_operands(rng, explicit_mesh)
  out_sharding = P("data", "tensor", None)
  cm.clear_decisions()
  with cm.config_context(enabled=True, impl="ring", strict=True):
    out = jax.jit(lambda a, b: cm.dot_general(
        a, b, DENSE, out_sharding=out_sharding))(x, w)
  decision = _only_decision()
  assert decision.rewritten and decision.collective == "reduce_scatter"
  assert (decision.impl, decision.axis, decision.mode) == (
      "ring", "tensor", "explicit")
  assert "reduce-scatter" in str(decision)
  assert jax.typeof(out).sharding.spec == out_sharding
  expected = lax.dot_general(x, w, DENSE, out_sharding=out_sharding)
  utils.assert_close_to_scale(out, utils.exact(expected), dtype="float32")


def test_explicit_all_reduce_is_left_to_xla(rng, explicit_mesh):
  x, w = _explicit_operands(rng, explicit_mesh)
  cm.clear_decisions()
  with cm.config_context(enabled=True, impl="ring", strict=True):
    out = cm.dot_general(x, w, DENSE, out_sharding=P("data", None, None))
  decision = _only_decision()
  assert not decision.rewritten and "all-reduced" in decision.reason
  np.testing.assert_array_equal(
      out, lax.dot_general(x, w, DENSE, out_sharding=P("data", None, None)))


def test_explicit_without_out_sharding_fails_as_jax_does(rng, explicit_mesh):
  # JAX 0.10.2 refuses a sharded contraction without out_sharding; the
  # override must not guess where the sum goes.
  x, w = _explicit_operands(rng, explicit_mesh)
  cm.clear_decisions()
  with cm.config_context(enabled=True, impl="ring", strict=True):
    with pytest.raises(Exception, match="Contracting dimensions are sharded"):
      cm.dot_general(x, w, DENSE)
  decision = _only_decision()
  assert not decision.rewritten and "out_sharding" in decision.reason


def test_explicit_unreduced_out_sharding_is_left_to_xla(rng, explicit_mesh):
  x, w = _explicit_operands(rng, explicit_mesh)
  out_sharding = P("data", None, None, unreduced={"tensor"})
  cm.clear_decisions()
  with cm.config_context(enabled=True, impl="ring", strict=True):
    cm.dot_general(x, w, DENSE, out_sharding=out_sharding)
  decision = _only_decision()
  assert not decision.rewritten and "unreduced" in decision.reason


def test_auto_impl_falls_back_without_a_reduce_scatter_kernel(
    rng, explicit_mesh):
  x, w = _explicit_operands(rng, explicit_mesh)
  cm.clear_decisions()
  with cm.config_context(enabled=True, impl="auto", strict=True):
    cm.dot_general(x, w, DENSE, out_sharding=P("data", "tensor", None))
  decision = _only_decision()
  assert decision.rewritten and decision.impl == "ring"
  assert decision.reason.startswith("pallas unavailable")


def test_strict_pallas_on_cpu_raises(rng, explicit_mesh):
  x, w = _explicit_operands(rng, explicit_mesh)
  with cm.config_context(enabled=True, impl="pallas", strict=True):
    with pytest.raises(ValueError, match="pallas unavailable"):
      cm.dot_general(x, w, DENSE, out_sharding=P("data", "tensor", None))


def test_all_gather_pattern_is_still_tried_first(rng, explicit_mesh):
  x = jax.device_put(rng.standard_normal((8, 16, 32)).astype(np.float32),
                     NamedSharding(explicit_mesh, P("data", "tensor", None)))
  w = jax.device_put(rng.standard_normal((32, 8)).astype(np.float32),
                     NamedSharding(explicit_mesh, P(None, "tensor")))
  cm.clear_decisions()
  with cm.config_context(enabled=True, impl="ring", strict=True):
    cm.dot_general(x, w, DENSE, out_sharding=P("data", None, "tensor"))
  decision = _only_decision()
  assert decision.rewritten and decision.collective == "all_gather"
  assert str(decision).endswith("over 'tensor'")


# Logical mode.

RULES = (("activation_batch", "data"), ("activation_length", "tensor"),
         ("activation_embed", None), ("activation_mlp", "tensor"),
         ("hidden_length", None), ("mlp", "tensor"), ("embed", None))
HIDDEN_AXES = ("activation_batch", "hidden_length", "activation_mlp")
BLOCK_AXES = ("activation_batch", "activation_length", "activation_embed")


@pytest.mark.parametrize("out_axes,rewritten", [(BLOCK_AXES, True),
                                                (None, False)])
def test_logical_out_axes_decide_the_reduce_scatter(rng, out_axes,
                                                    rewritten):
  mesh = utils.mesh(2, 4)
  h = jnp.asarray(rng.standard_normal((8, 16, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
  dot_general = cm.logical_dot_general(HIDDEN_AXES, ("mlp", "embed"),
                                       out_axes=out_axes, name="wo")
  cm.clear_decisions()
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES), cm.config_context(
      enabled=True, impl="ring", strict=True):
    h = jax.device_put(h, NamedSharding(mesh, P("data", None, "tensor")))
    w = jax.device_put(w, NamedSharding(mesh, P("tensor", None)))
    out = jax.jit(lambda a, b: dot_general(a, b, DENSE))(h, w)
  decision = _only_decision()
  assert decision.rewritten == rewritten, decision
  assert decision.mode == "logical" and decision.name == "wo"
  if rewritten:
    assert decision.collective == "reduce_scatter"
    assert out.sharding.is_equivalent_to(
        NamedSharding(mesh, P("data", "tensor", None)), out.ndim)
  else:
    assert "out_axes" in decision.reason
  utils.assert_close_to_scale(out, utils.exact(h) @ utils.exact(w),
                              dtype="float32")
