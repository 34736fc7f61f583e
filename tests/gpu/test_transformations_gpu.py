"""The Hopper kernels under JAX's transformations (issue 33 item 3): `grad`
(the other kernel in the backward), `jvp` (the kernel on the tangents),
`linearize`, and `vmap` of `grad` (the mapped dimension folded into the
kernel's rows, or into its columns), against an f32 reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import collective_matmul as cm

from gpu_env import HOPPER_COUNT
from gpu_env import poison as _poison
from gpu_env import rel_error as _rel
from gpu_env import ring_mesh as _mesh

D = min(2, HOPPER_COUNT) or 1
M, K, N = 512, 1024, 512


IMPL = "pallas"
SPECS = {"all_gather": ((P("x", None), P(None, "x")), P(None, "x")),
         "reduce_scatter": ((P(None, "x"), P("x", None)), P("x", None))}


def _op(collective):
  fn = functools.partial(
      cm.all_gather_matmul if collective == "all_gather"
      else cm.matmul_reduce_scatter, axis_name="x", impl=IMPL,
      backward_impl=IMPL)
  (x_spec, w_spec), out_spec = SPECS[collective]
  return jax.shard_map(fn, in_specs=(x_spec, w_spec), out_specs=out_spec,
                       check_vma=False)


def _put(collective, x, w, mapped=None):
  """x and w (and their tangents) placed as the op takes them; `mapped`:
  which one has a leading mapped dimension."""
  x_spec, w_spec = SPECS[collective][0]
  x_spec = P(None, *x_spec) if mapped == "x" else x_spec
  w_spec = P(None, *w_spec) if mapped == "w" else w_spec
  return (jax.sharding.reshard(x, x_spec), jax.sharding.reshard(w, w_spec))


def _operands(seed):
  keys = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
  w = jax.random.normal(keys[1], (K, N), jnp.bfloat16) / 32
  tx = jax.random.normal(keys[2], (M, K), jnp.bfloat16)
  tw = jax.random.normal(keys[3], (K, N), jnp.bfloat16) / 32
  return x, w, tx, tw


f32 = lambda a: np.asarray(a, np.float32)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_grad_jvp_and_linearize_run_the_kernels(collective):
  x, w, tx, tw = _operands(1)
  op = _op(collective)
  loss = lambda x, w: jnp.sum(op(x, w).astype(jnp.float32) ** 2)
  with jax.set_mesh(_mesh(D)):
    x, w = _put(collective, x, w)
    tx, tw = _put(collective, tx, tw)
    _poison(64 << 20)
    (dx, dw) = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    y, ty = jax.jit(lambda *a: jax.jvp(op, a[:2], a[2:]))(x, w, tx, tw)
    ty_lin = jax.jit(lambda *a: jax.linearize(op, *a[:2])[1](*a[2:]))(
        x, w, tx, tw)
    text = jax.jit(lambda *a: jax.jvp(op, a[:2], a[2:])).lower(
        x, w, tx, tw).as_text()
  y_ref = f32(x) @ f32(w)
  assert _rel(f32(y), y_ref) < 1e-2
  assert _rel(f32(dx), 2 * y_ref @ f32(w).T) < 3e-2
  assert _rel(f32(dw), 2 * f32(x).T @ y_ref) < 3e-2
  ty_ref = f32(tx) @ f32(w) + f32(x) @ f32(tw)
  assert _rel(f32(ty), ty_ref) < 2e-2
  assert _rel(f32(ty_lin), ty_ref) < 2e-2
  # Kernels: the primal and dx's tangent term, and dw's too for the
  # reduce-scatter (the all-gather's multiplies the gathered activation its
  # forward kept, in one local dot).
  expected = 2 if collective == "all_gather" else 3
  assert text.count("@mosaic_gpu_v2") == expected, text.count(
      "@mosaic_gpu_v2")


@pytest.mark.parametrize("mapped", ["x", "w"])
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_vmap_of_grad_runs_the_kernels(collective, mapped):
  x, w, tx, tw = _operands(2)
  op = _op(collective)
  loss = lambda x, w: jnp.sum(op(x, w).astype(jnp.float32) ** 2)
  xs = jnp.stack([x, tx]) if mapped == "x" else x
  ws = jnp.stack([w, tw]) if mapped == "w" else w
  axes = (0, None) if mapped == "x" else (None, 0)
  with jax.set_mesh(_mesh(D)):
    xs, ws = _put(collective, xs, ws, mapped)
    _poison(64 << 20)
    dxs, dws = jax.jit(jax.vmap(jax.grad(loss, (0, 1)), axes))(xs, ws)
  for i in range(2):
    xi = f32(xs[i] if mapped == "x" else xs)
    wi = f32(ws[i] if mapped == "w" else ws)
    y = xi @ wi
    assert _rel(f32(dxs[i]), 2 * y @ wi.T) < 3e-2
    assert _rel(f32(dws[i]), 2 * xi.T @ y) < 3e-2
