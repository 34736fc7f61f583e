"""jax.grad through the rewritten dot_general equals grad through einsum."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from cm_test_utils import DN_LAST, assert_close, mesh_1d, mesh_2d
from cm_test_utils import normal, put

# (mesh factory, x shape, x spec, w shape, w spec, out spec, einsum).
CASES = {
    "1d_rows": (lambda: mesh_1d(4), (16, 32), P("x", None), (32, 24),
                P(None, "x"), P(None, "x"), "mk,kn->mn"),
    "1d_seq": (lambda: mesh_1d(8), (2, 16, 32), P(None, "x", None), (32, 16),
               P(None, "x"), P(None, None, "x"), "bsk,kn->bsn"),
    "2x4_batch_seq": (lambda: mesh_2d((2, 4)), (4, 8, 32),
                      P("data", "tensor", None), (32, 16), P(None, "tensor"),
                      P("data", None, "tensor"), "bsk,kn->bsn"),
}


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("case", list(CASES))
def test_grad_through_rewrite_equals_grad_through_einsum(case, impl, keys):
  make_mesh, x_shape, x_spec, w_shape, w_spec, out_spec, eq = CASES[case]
  mesh = make_mesh()
  out_shape = x_shape[:-1] + w_shape[-1:]
  x = put(normal(keys(), x_shape, "float32"), mesh, x_spec)
  w = put(normal(keys(), w_shape, "float32"), mesh, w_spec)
  cot = put(normal(keys(), out_shape, "float32"), mesh, out_spec)

  def loss_cm(x, w, cot):
    y = cm.dot_general(x, w, DN_LAST(len(x_shape)))
    return jnp.sum(jnp.sin(y) * cot)

  def loss_einsum(x, w, cot):
    y = jnp.einsum(eq, x, w, out_sharding=out_spec)
    return jnp.sum(jnp.sin(y) * cot)

  grad = lambda loss: jax.jit(jax.grad(loss, argnums=(0, 1)))
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl=impl):
      dx, dw = grad(loss_cm)(x, w, cot)
    dx_ref, dw_ref = grad(loss_einsum)(x, w, cot)
  assert [d.rewritten for d in cm.decisions()] == [True]
  assert cm.decisions()[0].impl == impl
  assert jax.typeof(dx).sharding.spec == jax.typeof(x).sharding.spec
  assert jax.typeof(dw).sharding.spec == jax.typeof(w).sharding.spec
  assert_close(dx, np.asarray(dx_ref, np.float64), 1e-5)
  assert_close(dw, np.asarray(dw_ref, np.float64), 1e-5)
  # And against float64 numpy: dy = cos(x @ w) * cot.
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  dy = np.cos(x64 @ w64) * np.asarray(cot, np.float64)
  assert_close(dx, dy @ w64.T, 1e-5)
  lead = tuple(range(len(x_shape) - 1))
  assert_close(dw, np.tensordot(x64, dy, axes=(lead, lead)), 1e-5)


@pytest.mark.parametrize("impl", ["ring", "baseline"])
def test_grad_of_all_gather_matmul_in_shard_map(impl, keys):
  """The op itself, without the override, against the baseline op."""
  mesh = mesh_1d(4)
  x = put(normal(keys(), (2, 16, 32), "float32"), mesh, P(None, "x", None))
  w = put(normal(keys(), (32, 16), "float32"), mesh, P(None, "x"))
  cot = put(normal(keys(), (2, 16, 16), "float32"), mesh, P(None, None, "x"))

  def loss(impl, x, w, cot):
    y = jax.shard_map(
        lambda x, w: cm.all_gather_matmul(x, w, "x", gather_axis=1,
                                          impl=impl),
        mesh=mesh, in_specs=(P(None, "x", None), P(None, "x")),
        out_specs=P(None, None, "x"))(x, w)
    return jnp.sum(y * y * cot)

  dx, dw = jax.jit(jax.grad(lambda *a: loss(impl, *a), argnums=(0, 1)))(
      x, w, cot)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  dy = 2 * (x64 @ w64) * np.asarray(cot, np.float64)
  assert_close(dx, dy @ w64.T, 1e-5)
  assert_close(dw, np.tensordot(x64, dy, axes=((0, 1), (0, 1))), 1e-5)
