"""fp8 operands through the collective matmuls (`ring`, `baseline`) and the
drop-in, against a float64 reference of the fp8 values."""
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from cm_test_utils import mesh_1d, normal, put

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# The operand pairs of Flax's fp8 matmuls: forward, and the e5m2 cotangent
# times an e4m3 operand.
PAIRS = {"e4m3_e4m3": (E4M3, E4M3), "e5m2_e4m3": (E5M2, E4M3)}
D, K, N_LOCAL = 4, 64, 16
# One rounding of the result (f32 sums of exact fp8 products).
ROUNDING = {"float32": 2.0**-20, "bfloat16": 2.0**-8}


def _fp8(keys, shape, dtype):
  return normal(keys(), shape, jnp.float32).astype(dtype)


def _exact(array):
  return np.asarray(jnp.asarray(array, jnp.float32), np.float64)


def _assert_rounded_once(out, ref, out_dtype):
  """`out` is `ref` rounded to `out_dtype` once (plus f32 sums' error)."""
  out = _exact(out)
  bound = ROUNDING[out_dtype] * np.abs(ref) + 1e-6 * np.max(np.abs(ref))
  np.testing.assert_array_less(np.abs(out - ref), bound + 1e-30)


def _run(op, x, w, x_spec, w_spec, out_spec, mesh, **kwargs):
  body = functools.partial(op, axis_name="x", **kwargs)
  return jax.jit(jax.shard_map(
      lambda x, w: body(x, w), mesh=mesh, in_specs=(x_spec, w_spec),
      out_specs=out_spec))(x, w)


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_fp8_all_gather_matmul_matches_float64_reference(impl, pair,
                                                         out_dtype, keys):
  mesh = mesh_1d(D)
  x_dtype, w_dtype = PAIRS[pair]
  x = put(_fp8(keys, (D * 8, K), x_dtype), mesh, P("x", None))
  w = put(_fp8(keys, (K, D * N_LOCAL), w_dtype), mesh, P(None, "x"))
  y = _run(cm.all_gather_matmul, x, w, P("x", None), P(None, "x"),
           P(None, "x"), mesh, impl=impl, preferred_element_type=out_dtype)
  assert y.dtype == jnp.dtype(out_dtype)
  _assert_rounded_once(y, _exact(x) @ _exact(w), out_dtype)


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_fp8_ring_reduce_scatter_sums_in_float32(pair, out_dtype, keys):
  # D partial products summed in f32 and rounded once: what one fp8 GEMM
  # over the whole contraction gives.
  mesh = mesh_1d(D)
  x_dtype, w_dtype = PAIRS[pair]
  x = put(_fp8(keys, (D * 8, D * K), x_dtype), mesh, P(None, "x"))
  w = put(_fp8(keys, (D * K, N_LOCAL), w_dtype), mesh, P("x", None))
  y = _run(cm.matmul_reduce_scatter, x, w, P(None, "x"), P("x", None),
           P("x", None), mesh, impl="ring", preferred_element_type=out_dtype)
  assert y.dtype == jnp.dtype(out_dtype)
  _assert_rounded_once(y, _exact(x) @ _exact(w), out_dtype)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_fp8_baseline_reduce_scatter_matches_float64_reference(pair, keys):
  # XLA's reduce-scatter sums the bf16 partial products in bf16.
  mesh = mesh_1d(D)
  x_dtype, w_dtype = PAIRS[pair]
  x = put(_fp8(keys, (D * 8, D * K), x_dtype), mesh, P(None, "x"))
  w = put(_fp8(keys, (D * K, N_LOCAL), w_dtype), mesh, P("x", None))
  y = _run(cm.matmul_reduce_scatter, x, w, P(None, "x"), P("x", None),
           P("x", None), mesh, impl="baseline",
           preferred_element_type="bfloat16")
  ref = _exact(x) @ _exact(w)
  np.testing.assert_allclose(_exact(y), ref, rtol=0,
                             atol=D * 2.0**-8 * np.max(np.abs(ref)))


@pytest.mark.parametrize("impl", ["ring", "baseline"])
def test_grad_through_the_op_on_fp8_operands_matches_lax(impl, keys):
  mesh = mesh_1d(D, jax.sharding.AxisType.Auto)
  x = _fp8(keys, (D * 8, K), E4M3)
  w = _fp8(keys, (K, D * N_LOCAL), E4M3)
  t = normal(keys(), (D * 8, D * N_LOCAL), jnp.float32)

  def ours(x, w):
    y = jax.shard_map(
        lambda x, w: cm.all_gather_matmul(
            x, w, "x", impl=impl, preferred_element_type=jnp.bfloat16),
        mesh=mesh, in_specs=(P("x", None), P(None, "x")),
        out_specs=P(None, "x"))(x, w)
    return jnp.sum(y.astype(jnp.float32) * t)

  def plain(x, w):
    y = lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                        preferred_element_type=jnp.bfloat16)
    return jnp.sum(y.astype(jnp.float32) * t)

  for got, want in zip(jax.jit(jax.grad(ours, (0, 1)))(x, w),
                       jax.grad(plain, (0, 1))(x, w)):
    assert got.dtype == want.dtype == jnp.dtype(E4M3)
    # Within one e4m3 rounding (3 mantissa bits) of the plain gradient.
    got, want = _exact(got), _exact(want)
    np.testing.assert_array_less(
        np.abs(got - want),
        2.0**-3 * np.abs(want) + 1e-3 * np.max(np.abs(want)))


def test_drop_in_serves_fp8_operands_and_names_their_dtypes(keys):
  mesh = mesh_1d(D)
  x = put(_fp8(keys, (2, D * 4, K), E4M3), mesh, P(None, "x", None))
  w = put(_fp8(keys, (K, D * N_LOCAL), E4M3), mesh, P(None, "x"))
  dims = (((2,), (0,)), ((), ()))
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    y = jax.jit(functools.partial(cm.dot_general, dimension_numbers=dims,
                                  preferred_element_type=jnp.bfloat16))(x, w)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.impl == "ring"
  assert decision.dtype == "e4m3 x e4m3 -> bf16"
  assert decision.what_runs() == "ring e4m3 x e4m3 -> bf16 over 'x'"
  # The line names the dtypes once; the ring's backward (bf16) is no
  # other implementation, so the line does not mention it.
  assert str(decision).endswith("e4m3 x e4m3 -> bf16: rewritten -> ring "
                                "over 'x'"), str(decision)
  _assert_rounded_once(y, np.einsum("bsk,kn->bsn", _exact(x), _exact(w)),
                       "bfloat16")


def test_drop_in_serves_the_fp8_gradient_reduce_scatter(keys):
  # Flax's dgrad: the e5m2 cotangent times the e4m3 weight, summed over the
  # weight's sharded output features, wanted in the activation's layout.
  mesh = mesh_1d(D)
  g = put(_fp8(keys, (D * 4, D * N_LOCAL), E5M2), mesh, P(None, "x"))
  w = put(_fp8(keys, (K, D * N_LOCAL), E4M3), mesh, P(None, "x"))
  dims = (((1,), (1,)), ((), ()))
  out = jax.sharding.NamedSharding(mesh, P("x", None))
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    dx = jax.jit(functools.partial(
        cm.dot_general, dimension_numbers=dims, out_sharding=out,
        preferred_element_type=jnp.float32))(g, w)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.collective == "reduce_scatter"
  assert decision.dtype == "e5m2 x e4m3 -> f32"
  _assert_rounded_once(dx, _exact(g) @ _exact(w).T, "float32")


def test_fp8_without_preferred_element_type_is_left_to_xla(keys):
  mesh = mesh_1d(D)
  x = put(_fp8(keys, (D * 8, K), E4M3), mesh, P("x", None))
  w = put(_fp8(keys, (K, D * N_LOCAL), E4M3), mesh, P(None, "x"))
  dims = (((1,), (0,)), ((), ()))
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    y = cm.dot_general(x, w, dims, out_sharding=P(None, "x"))
  (decision,) = cm.decisions()
  assert not decision.rewritten
  assert "without preferred_element_type" in decision.reason
  assert y.dtype == jnp.dtype(E4M3)
