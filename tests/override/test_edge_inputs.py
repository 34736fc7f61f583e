"""Inputs at the edges: what lax accepts the plugin accepts, with lax's
results and lax's errors (issue 15: D1, D2, D3, D7)."""
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from cm_test_utils import mesh_1d, mesh_2d, put

DN = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize("lhs_shape,rhs_shape", [
    ((8, 0), (0, 8)),    # empty contraction: zeros
    ((0, 16), (16, 8)),  # no rows
])
def test_zero_size_dimensions_run_as_lax_does(lhs_shape, rhs_shape):
  mesh = mesh_2d((2, 4))
  x = put(np.ones(lhs_shape, np.float32), mesh, P("tensor", None))
  w = put(np.ones(rhs_shape, np.float32), mesh, P(None, "tensor"))
  out = jax.sharding.NamedSharding(mesh, P(None, "tensor"))
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    y = cm.dot_general(x, w, DN, out_sharding=out)
    expected = lax.dot_general(x, w, DN, out_sharding=out)
  assert (y.shape, y.dtype) == (expected.shape, expected.dtype)
  if y.size:  # (JAX cannot fetch a sharded empty array to numpy.)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))
  (decision,) = cm.decisions()
  assert not decision.rewritten and "empty operand" in decision.reason


@pytest.mark.parametrize("dims", [
    (((5,), (0,)), ((), ())),   # contraction index out of range
    (((1,), (1,)), ((), ())),   # contraction sizes differ (16 vs 8)
])
def test_bad_dimension_numbers_raise_lax_type_error(dims):
  mesh = mesh_2d((2, 4))
  x = put(np.ones((8, 16), np.float32), mesh, P("tensor", None))
  w = put(np.ones((16, 8), np.float32), mesh, P(None, "tensor"))
  with jax.set_mesh(mesh):
    with pytest.raises(TypeError) as lax_error:
      lax.dot_general(x, w, dims)
    with cm.config_context(enabled=True, impl="ring"):
      with pytest.raises(TypeError) as ours:
        cm.dot_general(x, w, dims)
  assert str(ours.value) == str(lax_error.value)


@pytest.mark.parametrize("op,in_specs,out_spec", [
    ("matmul_reduce_scatter", (P(None, "x"), P("x", None)), P("x", None)),
    ("all_gather_matmul", (P("x", None), P(None, "x")), P(None, "x")),
])
@pytest.mark.parametrize("impl", ["ring", "baseline"])
def test_integer_operands_are_exact_and_wrap_like_lax(op, in_specs, out_spec,
                                                      impl):
  mesh = mesh_1d(4, axis_type=jax.sharding.AxisType.Auto)
  rng = np.random.default_rng(0)
  # Large enough that the sum overflows int32 and wraps.
  x = rng.integers(2**20, 2**21, (8, 16), dtype=np.int32)
  w = rng.integers(2**9, 2**10, (16, 8), dtype=np.int32)
  fn = jax.jit(jax.shard_map(
      lambda a, b: getattr(cm, op)(a, b, "x", impl=impl), mesh=mesh,
      in_specs=in_specs, out_specs=out_spec))
  y = fn(put(x, mesh, in_specs[0]), put(w, mesh, in_specs[1]))
  expected = lax.dot_general(jnp.asarray(x), jnp.asarray(w), DN)
  assert y.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))


@pytest.mark.parametrize("op,in_specs", [
    ("matmul_reduce_scatter", (P(None, "x"), P("x", None))),
    ("all_gather_matmul", (P("x", None), P(None, "x"))),
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_says_what_hardware_and_dtype_it_needs(op, in_specs, dtype):
  if jax.default_backend() != "cpu":
    pytest.skip("checks the message on a machine without a Hopper GPU")
  mesh = mesh_1d(2, axis_type=jax.sharding.AxisType.Auto)
  x = put(np.ones((256, 256), dtype), mesh, in_specs[0])
  w = put(np.ones((256, 256), dtype), mesh, in_specs[1])
  fn = jax.shard_map(lambda a, b: getattr(cm, op)(a, b, "x", impl="pallas"),
                     mesh=mesh, in_specs=in_specs, out_specs=P("x", None))
  with pytest.raises(ValueError, match="impl='pallas'.*Hopper"):
    jax.jit(fn)(x, w)


def test_pallas_is_refused_where_unchecked_command_buffers_capture_it(
    monkeypatch):
  """On a JAX whose kernels were not checked under CUDA-graph capture, an
  explicit impl='pallas' with custom calls in XLA's command buffers says so,
  on a machine that otherwise could run it."""
  from collective_matmul import ops
  from collective_matmul import selection
  from collective_matmul.enums import Collective
  from collective_matmul.selection import applicability
  hopper = selection.DeviceFacts("gpu", "NVIDIA H200", 132)
  monkeypatch.setattr(selection, "device_facts", lambda mesh=None: hopper)
  monkeypatch.setattr(applicability, "_jax_version", lambda: (0, 10))
  mesh = mesh_1d(2, axis_type=jax.sharding.AxisType.Auto)
  operands = (jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),) * 2

  def trace(body):
    # The op decides its plan at trace time, inside shard_map (D = 2).
    return jax.eval_shape(jax.shard_map(
        body, mesh=mesh, in_specs=(P("x", None), P(None, "x")),
        out_specs=P("x", None)), *operands)

  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  with pytest.raises(ValueError, match="command buffers.*JAX 0.10.*"
                     "--xla_gpu_enable_command_buffer=-CUSTOM_CALL"):
    trace(lambda a, b: cm.all_gather_matmul(a, b, "x", impl="pallas"))
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=-CUSTOM_CALL")
  plans = []

  def plan_only(a, b):
    plans.append(ops._plan(Collective.ALL_GATHER, a, b, 0, "x", "pallas",  # pylint: disable=protected-access
                           None, None, None, None, None))
    return a
  trace(plan_only)
  (plan,) = plans
  assert plan.impl == "pallas" and not plan.is_fallback, plan
