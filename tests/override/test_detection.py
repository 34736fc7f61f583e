"""Pattern detection by the drop-in dot_general, from both sharding sources."""
import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from cm_test_utils import DN_LAST, TOLERANCE, assert_close, mesh_1d
from cm_test_utils import mesh_2d, normal, put, reference


def _run_explicit(mesh, x, w, dn, impl="ring", with_plain=True, **kwargs):
  """cm.dot_general and (for negatives) lax.dot_general, jitted, same args."""
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl=impl):
      y = jax.jit(lambda x, w: cm.dot_general(x, w, dn, **kwargs))(x, w)
    if not with_plain:
      return y, None
    plain = jax.jit(lambda x, w: lax.dot_general(x, w, dn, **kwargs))(x, w)
  return y, plain


def _only_decision():
  records = cm.decisions()
  assert len(records) == 1, records
  return records[0]


# ---------------------------------------------------------------- explicit


@pytest.mark.parametrize("d", [2, 4, 8])
def test_explicit_rows_sharded_pattern_is_rewritten(d, keys):
  mesh = mesh_1d(d)
  x = put(normal(keys(), (d * 4, 32), "float32"), mesh, P("x", None))
  w = put(normal(keys(), (32, d * 8), "float32"), mesh, P(None, "x"))
  y, _ = _run_explicit(mesh, x, w, DN_LAST(2), with_plain=False)
  decision = _only_decision()
  assert decision.rewritten and decision.impl == "ring"
  assert decision.axis == "x" and decision.mode == "explicit"
  assert decision.lhs_shape == x.shape and decision.rhs_shape == w.shape
  assert jax.typeof(y).sharding.spec == P(None, "x")
  assert_close(y, reference(x, w), TOLERANCE["float32"])


def test_explicit_transposed_operands_are_rewritten(keys):
  """Non-canonical dimension numbers: x[k, m] and w[n, k]."""
  mesh = mesh_1d(4)
  x = put(normal(keys(), (32, 16), "float32"), mesh, P(None, "x"))
  w = put(normal(keys(), (24, 32), "float32"), mesh, P("x", None))
  dn = (((0,), (1,)), ((), ()))
  y, _ = _run_explicit(mesh, x, w, dn, with_plain=False)
  decision = _only_decision()
  assert decision.rewritten and decision.axis == "x"
  assert_close(y, reference(np.asarray(x).T, np.asarray(w).T), 1e-5)


def test_explicit_impl_auto_falls_back_to_ring_on_cpu(keys):
  mesh = mesh_1d(4)
  x = put(normal(keys(), (16, 32), "bfloat16"), mesh, P("x", None))
  w = put(normal(keys(), (32, 32), "bfloat16"), mesh, P(None, "x"))
  y, _ = _run_explicit(mesh, x, w, DN_LAST(2), impl="auto",
                       with_plain=False)
  decision = _only_decision()
  assert decision.rewritten and decision.impl == "ring"
  assert "pallas unavailable" in decision.reason and "cpu" in decision.reason
  assert_close(y, reference(x, w), TOLERANCE["bfloat16"])


def _check_left_to_xla(y, plain, reason_parts, exact=True):
  decision = _only_decision()
  assert not decision.rewritten and decision.impl is None
  assert decision.axis is None
  for part in reason_parts:
    assert part in decision.reason, (part, decision.reason)
  assert jax.typeof(y) == jax.typeof(plain)
  if exact:
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain))
  return decision


def test_explicit_contracting_dim_sharded_is_not_rewritten(keys):
  mesh = mesh_2d((2, 4))
  x = put(normal(keys(), (16, 32), "float32"), mesh, P("tensor", "data"))
  w = put(normal(keys(), (32, 16), "float32"), mesh, P("data", "tensor"))
  y, plain = _run_explicit(mesh, x, w, DN_LAST(2),
                           out_sharding=P(None, "tensor"))
  _check_left_to_xla(y, plain, ["contracting dimension", "data"])


def test_explicit_rhs_output_not_sharded_is_not_rewritten(keys):
  mesh = mesh_1d(4)
  x = put(normal(keys(), (16, 32), "float32"), mesh, P("x", None))
  w = put(normal(keys(), (32, 16), "float32"), mesh, P(None, None))
  y, plain = _run_explicit(mesh, x, w, DN_LAST(2))
  _check_left_to_xla(y, plain, ["no mesh axis", "rhs output"])


def test_explicit_lhs_rows_not_sharded_is_not_rewritten(keys):
  mesh = mesh_1d(4)
  x = put(normal(keys(), (16, 32), "float32"), mesh, P(None, None))
  w = put(normal(keys(), (32, 16), "float32"), mesh, P(None, "x"))
  y, plain = _run_explicit(mesh, x, w, DN_LAST(2))
  _check_left_to_xla(y, plain, ["no mesh axis", "lhs row"])


def test_explicit_batch_dimension_numbers_are_not_rewritten(keys):
  mesh = mesh_1d(4)
  x = put(normal(keys(), (2, 16, 32), "float32"), mesh, P(None, "x", None))
  w = put(normal(keys(), (2, 32, 16), "float32"), mesh, P(None, None, "x"))
  dn = (((2,), (1,)), ((0,), (0,)))
  y, plain = _run_explicit(mesh, x, w, dn, out_sharding=P(None, None, "x"))
  _check_left_to_xla(y, plain, ["batch dimensions"])


def test_explicit_out_sharding_keeping_rows_sharded_is_not_rewritten(keys):
  mesh = mesh_1d(4)
  x = put(normal(keys(), (16, 32), "float32"), mesh, P("x", None))
  w = put(normal(keys(), (32, 16), "float32"), mesh, P(None, "x"))
  y, plain = _run_explicit(mesh, x, w, DN_LAST(2), out_sharding=P("x", None))
  decision = _check_left_to_xla(y, plain, ["out_sharding"])
  assert "x" in decision.reason
  assert jax.typeof(y).sharding.spec == P("x", None)


def test_explicit_mismatched_dtypes_fall_back_to_plain(keys):
  mesh = mesh_1d(4)
  x = put(normal(keys(), (16, 32), "float32"), mesh, P("x", None))
  w = put(normal(keys(), (32, 16), "bfloat16"), mesh, P(None, "x"))
  y, plain = _run_explicit(mesh, x, w, DN_LAST(2),
                           out_sharding=P(None, "x"))
  _check_left_to_xla(y, plain, ["dtypes differ", "float32", "bfloat16"])


def test_explicit_unsupported_dtype_falls_back_to_plain(keys):
  mesh = mesh_1d(4)
  x = put(jax.random.randint(keys(), (16, 32), -8, 8, jnp.int32), mesh,
          P("x", None))
  w = put(jax.random.randint(keys(), (32, 16), -8, 8, jnp.int32), mesh,
          P(None, "x"))
  y, plain = _run_explicit(mesh, x, w, DN_LAST(2),
                           out_sharding=P(None, "x"))
  _check_left_to_xla(y, plain, ["unsupported dtype", "int32"])
  np.testing.assert_array_equal(
      np.asarray(y), np.asarray(x, np.int64) @ np.asarray(w, np.int64))


def test_explicit_operands_without_sharding_are_not_rewritten(keys):
  x = normal(keys(), (16, 32), "float32")
  w = normal(keys(), (32, 16), "float32")
  with cm.config_context(enabled=True, impl="ring"):
    y = jax.jit(lambda x, w: cm.dot_general(x, w, DN_LAST(2)))(x, w)
  plain = jax.jit(lambda x, w: lax.dot_general(x, w, DN_LAST(2)))(x, w)
  _check_left_to_xla(y, plain, ["no explicit sharding"])


def test_explicit_api_on_auto_mesh_is_not_rewritten(keys):
  """Auto axes carry no sharding in the types: explicit mode can't see it."""
  mesh = mesh_1d(4, AxisType.Auto)
  x = put(normal(keys(), (16, 32), "float32"), mesh, P("x", None))
  w = put(normal(keys(), (32, 16), "float32"), mesh, P(None, "x"))
  y, plain = _run_explicit(mesh, x, w, DN_LAST(2))
  _check_left_to_xla(y, plain, ["no explicit sharding"])


def test_explicit_disabled_records_nothing(keys):
  mesh = mesh_1d(4)
  x = put(normal(keys(), (16, 32), "float32"), mesh, P("x", None))
  w = put(normal(keys(), (32, 16), "float32"), mesh, P(None, "x"))
  with jax.set_mesh(mesh), cm.config_context(enabled=False, impl="ring"):
    y = jax.jit(lambda x, w: cm.dot_general(
        x, w, DN_LAST(2), out_sharding=P(None, "x")))(x, w)
  assert not cm.decisions()
  assert_close(y, reference(x, w), 1e-5)


def test_explicit_inside_shard_map_is_not_rewritten(keys):
  """Partial shard_map over 'data': 'tensor' still Explicit, 'data' Manual."""
  mesh = mesh_2d((2, 4))
  x = put(normal(keys(), (4, 16, 32), "float32"), mesh,
          P("data", "tensor", None))
  w = put(normal(keys(), (32, 16), "float32"), mesh, P(None, "tensor"))
  out_spec = P(None, None, "tensor")
  body = lambda x, w: cm.dot_general(x, w, DN_LAST(3), out_sharding=out_spec)
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    y = jax.jit(jax.shard_map(body, in_specs=(P("data"), P()),
                              out_specs=P("data"), axis_names={"data"}))(x, w)
  decision = _only_decision()
  assert not decision.rewritten and "shard_map" in decision.reason
  assert_close(y, reference(x, w), 1e-5)


# ----------------------------------------------------------------- logical

RULES = [("batch", "data"), ("seq", "tensor"), ("embed", None),
         ("mlp", "tensor")]


def _run_logical(mesh, rules, x, w, lhs_axes=("batch", "seq", "embed"),
                 rhs_axes=("embed", "mlp"), impl="ring"):
  dot = cm.logical_dot_general(lhs_axes, rhs_axes, name="mlp_in")
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    with cm.config_context(enabled=True, impl=impl):
      y = jax.jit(lambda x, w: dot(x, w, DN_LAST(x.ndim)))(x, w)
  return y


def _logical_inputs(mesh, keys, dtype="float32"):
  data, tensor = mesh.axis_sizes
  x = jax.device_put(normal(keys(), (data * 2, tensor * 4, 32), dtype),
                     NamedSharding(mesh, P("data", "tensor", None)))
  w = jax.device_put(normal(keys(), (32, tensor * 8), dtype),
                     NamedSharding(mesh, P(None, "tensor")))
  return x, w


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_logical_pattern_is_rewritten(shape, impl, keys):
  mesh = mesh_2d(shape, AxisType.Auto)
  x, w = _logical_inputs(mesh, keys)
  y = _run_logical(mesh, RULES, x, w, impl=impl)
  decision = _only_decision()
  assert decision.rewritten and decision.impl == impl
  assert decision.axis == "tensor" and decision.mode == "logical"
  assert decision.name == "mlp_in"
  assert_close(y, reference(x, w), TOLERANCE["float32"])


def test_logical_batch_over_data_and_tensor_is_rewritten(keys):
  mesh = mesh_2d((2, 4), AxisType.Auto)
  x = normal(keys(), (16, 4, 32), "float32")
  w = normal(keys(), (32, 32), "float32")
  rules = [("batch", ("data", "tensor")), ("seq", None), ("embed", None),
           ("mlp", "tensor")]
  y = _run_logical(mesh, rules, x, w)
  decision = _only_decision()
  assert decision.rewritten and decision.axis == "tensor"
  assert_close(y, reference(x, w), TOLERANCE["float32"])


def test_logical_rewritten_program_has_no_all_gather(keys):
  mesh = mesh_2d((2, 4), AxisType.Auto)
  x, w = _logical_inputs(mesh, keys)
  dot = cm.logical_dot_general(("batch", "seq", "embed"), ("embed", "mlp"))
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    with cm.config_context(enabled=True, impl="ring"):
      text = jax.jit(lambda x, w: dot(x, w, DN_LAST(3))).lower(
          x, w).compile().as_text()
  assert _only_decision().rewritten
  assert "collective-permute" in text and "all-gather" not in text


def test_logical_axis_not_in_mesh_falls_back(keys):
  mesh = mesh_2d((2, 4), AxisType.Auto)
  x, w = _logical_inputs(mesh, keys)
  rules = [("batch", "data"), ("seq", "tensor"), ("embed", None),
           ("mlp", "model")]
  y = _run_logical(mesh, rules, x, w)
  decision = _only_decision()
  assert not decision.rewritten and "'model'" in decision.reason
  assert "not in the mesh" in decision.reason
  assert_close(y, reference(x, w), TOLERANCE["float32"])


def test_logical_axis_not_in_mesh_raises_in_strict(keys):
  mesh = mesh_2d((2, 4), AxisType.Auto)
  x, w = _logical_inputs(mesh, keys)
  dot = cm.logical_dot_general(("batch", "seq", "embed"), ("embed", "mlp"))
  rules = [("batch", "data"), ("seq", "tensor"), ("mlp", "model")]
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    with cm.config_context(enabled=True, impl="ring", strict=True):
      with pytest.raises(ValueError, match="model"):
        jax.jit(lambda x, w: dot(x, w, DN_LAST(3)))(x, w)


def test_logical_non_divisible_batch_falls_back(keys):
  """Batch 4 over data x tensor = 8 shards: detected, but can't be served."""
  mesh = mesh_2d((2, 4), AxisType.Auto)
  x = normal(keys(), (4, 4, 32), "float32")
  w = normal(keys(), (32, 32), "float32")
  rules = [("batch", ("data", "tensor")), ("mlp", "tensor")]
  y = _run_logical(mesh, rules, x, w)
  decision = _only_decision()
  assert not decision.rewritten
  assert "not divisible" in decision.reason and "size 4" in decision.reason
  assert_close(y, reference(x, w), TOLERANCE["float32"])
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    with cm.config_context(enabled=True, impl="ring", strict=True):
      dot = cm.logical_dot_general(("batch", "seq", "embed"),
                                   ("embed", "mlp"))
      with pytest.raises(ValueError, match="not divisible"):
        jax.jit(lambda x, w: dot(x, w, DN_LAST(3)))(x, w)


def test_logical_seq_not_sharded_is_not_rewritten(keys):
  mesh = mesh_2d((2, 4), AxisType.Auto)
  x, w = _logical_inputs(mesh, keys)
  rules = [("batch", "data"), ("seq", None), ("embed", None),
           ("mlp", "tensor")]
  y = _run_logical(mesh, rules, x, w)
  decision = _only_decision()
  assert not decision.rewritten and "no mesh axis" in decision.reason
  assert_close(y, reference(x, w), TOLERANCE["float32"])


def test_logical_without_mesh_falls_back(keys):
  x = normal(keys(), (4, 8, 32), "float32")
  w = normal(keys(), (32, 16), "float32")
  dot = cm.logical_dot_general(("batch", "seq", "embed"), ("embed", "mlp"))
  with nn.logical_axis_rules(RULES):
    with cm.config_context(enabled=True, impl="ring"):
      y = jax.jit(lambda x, w: dot(x, w, DN_LAST(3)))(x, w)
  decision = _only_decision()
  assert not decision.rewritten and "no mesh" in decision.reason
  assert_close(y, reference(x, w), TOLERANCE["float32"])


def test_logical_axes_of_wrong_rank_fall_back(keys):
  mesh = mesh_2d((2, 4), AxisType.Auto)
  x, w = _logical_inputs(mesh, keys)
  y = _run_logical(mesh, RULES, x, w, lhs_axes=("batch", "embed"))
  decision = _only_decision()
  assert not decision.rewritten and "('batch', 'embed')" in decision.reason
  assert_close(y, reference(x, w), TOLERANCE["float32"])


def test_enabling_plugin_applies_to_already_jitted_function(keys):
  """The configuration is part of JAX's cache key (config._TRACE_KEY): a
  function jitted with the plugin off is traced again when it is on."""
  mesh = mesh_1d(4)
  x = put(normal(keys(), (16, 32), "float32"), mesh, P("x", None))
  w = put(normal(keys(), (32, 16), "float32"), mesh, P(None, "x"))
  f = jax.jit(lambda x, w: cm.dot_general(x, w, DN_LAST(2),
                                          out_sharding=P(None, "x")))
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=False):
      f(x, w)
    with cm.config_context(enabled=True, impl="ring"):
      text = f.lower(x, w).compile().as_text()
  assert [d.rewritten for d in cm.decisions()] == [True]
  assert "collective-permute" in text
