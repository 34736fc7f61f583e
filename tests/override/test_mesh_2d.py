"""The drop-in dot_general on 2-D data x tensor meshes (Explicit axes)."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import pytest

import collective_matmul as cm
from cm_test_utils import DN_LAST, TOLERANCE, assert_close, mesh_2d
from cm_test_utils import normal, put, reference

# (x spec, expected output spec): batch on data + seq on tensor, seq only,
# batch over ('data', 'tensor') with tensor minor.
LAYOUTS = {
    "batch_data_seq_tensor": (P("data", "tensor", None),
                              P("data", None, "tensor")),
    "seq_tensor": (P(None, "tensor", None), P(None, None, "tensor")),
    "batch_data_tensor": (P(("data", "tensor"), None, None),
                          P("data", None, "tensor")),
}


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_dot_general_on_2d_mesh_matches_reference(shape, layout, dtype, impl,
                                                  keys):
  mesh = mesh_2d(shape)
  data, tensor = shape
  x_spec, out_spec = LAYOUTS[layout]
  x = normal(keys(), (data * tensor, tensor * 4, 32), dtype)
  w = normal(keys(), (32, tensor * 8), dtype)
  x, w = put(x, mesh, x_spec), put(w, mesh, P(None, "tensor"))

  @jax.jit
  def f(x, w):
    return cm.dot_general(x, w, DN_LAST(3))

  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl=impl):
    y = f(x, w)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.impl == impl
  assert decision.axis == "tensor" and decision.mode == "explicit"
  assert jax.typeof(y).sharding.spec == out_spec
  assert y.sharding.spec == out_spec
  assert y.dtype == jnp.dtype(dtype)
  assert_close(y, reference(x, w), TOLERANCE[dtype])


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_dot_general_honours_matching_out_sharding_on_2d_mesh(shape, keys):
  mesh = mesh_2d(shape)
  data, tensor = shape
  x = put(normal(keys(), (data * 2, tensor * 4, 32), "float32"), mesh,
          P("data", "tensor", None))
  w = put(normal(keys(), (32, tensor * 8), "float32"), mesh,
          P(None, "tensor"))
  out_spec = P("data", None, "tensor")

  @jax.jit
  def f(x, w):
    return cm.dot_general(x, w, DN_LAST(3), out_sharding=out_spec)

  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    y = f(x, w)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.axis == "tensor"
  assert jax.typeof(y).sharding.spec == out_spec
  assert_close(y, reference(x, w), TOLERANCE["float32"])
