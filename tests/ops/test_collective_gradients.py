"""Backward passes of both collective matmuls against autodiff of the
baselines, and the `save_gathered` memory policy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from collective_matmul import ops
from collective_matmul import ring
from collective_matmul import selection
from collective_matmul.enums import Collective
import cm_test_utils as utils


def _loss_and_grads(fn, mesh, in_specs, out_spec, cotangent, **kwargs):
  """value_and_grad of <fn(x, w), cotangent>: the cotangent is random, so a
  misplaced gradient block shows."""
  body = lambda x, w: fn(x, w, "tensor", **kwargs)
  sharded = jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                          out_specs=out_spec, check_vma=False)
  loss = lambda x, w: jnp.sum(sharded(x, w).astype(jnp.float32) * cotangent)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _reduce_scatter_problem(rng, data, tensor, dtype):
  x = utils.cast(rng.standard_normal((2 * data * tensor, 3 * tensor,
                                      4 * tensor)), dtype)
  w = utils.cast(rng.standard_normal((4 * tensor, 5)), dtype)
  cotangent = rng.standard_normal((2 * data * tensor, 3 * tensor, 5))
  return x, w, jnp.asarray(cotangent, jnp.float32)


def _all_gather_problem(rng, data, tensor, dtype):
  x = utils.cast(rng.standard_normal((2 * data * tensor, 3 * tensor, 5)),
                 dtype)
  w = utils.cast(rng.standard_normal((5, 2 * tensor)), dtype)
  cotangent = rng.standard_normal((2 * data * tensor, 3 * tensor,
                                   2 * tensor))
  return x, w, jnp.asarray(cotangent, jnp.float32)


def _op_problem(rng, op, dtype):
  """(x, w, cotangent, in_specs, out_spec, op fn, baseline fn, kwargs) on a
  2 x 4 mesh, the collective over axis 1 of 3-D activations."""
  if op == "all_gather":
    x, w, cotangent = _all_gather_problem(rng, 2, 4, dtype)
    in_specs, out_spec = utils.all_gather_specs(3, 1)
    return (x, w, cotangent, in_specs, out_spec, ops.all_gather_matmul,
            ring.baseline_all_gather_matmul, {"gather_axis": 1})
  x, w, cotangent = _reduce_scatter_problem(rng, 2, 4, dtype)
  in_specs, out_spec = utils.reduce_scatter_specs(3, 1)
  return (x, w, cotangent, in_specs, out_spec, ops.matmul_reduce_scatter,
          ring.baseline_matmul_reduce_scatter, {"scatter_axis": 1})


def _assert_same_loss(actual, expected, cotangent, k):
  # A scalar has no spread to scale by: use the size of the terms summed,
  # |y| ~ sqrt(k) times |cotangent|, so a loss near zero is no false alarm.
  scale = float(np.sqrt(k) * np.sum(np.abs(np.asarray(cotangent))))
  utils.assert_close_to_scale(actual, utils.exact(expected),
                              dtype="float32", scale=scale)


def _assert_same(actual, expected, dtype):
  for a, e in zip(actual, expected):
    assert a.dtype == e.dtype
    utils.assert_close_to_scale(a, utils.exact(e), dtype=dtype)


@pytest.mark.parametrize("data,tensor", utils.MESH_SHAPES)
@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("scatter_axis", [0, 1])
def test_matmul_reduce_scatter_grads_equal_baseline_autodiff(
    rng, data, tensor, impl, scatter_axis):
  mesh = utils.mesh(data, tensor)
  x, w, cotangent = _reduce_scatter_problem(rng, data, tensor, "float32")
  in_specs, out_spec = utils.reduce_scatter_specs(3, scatter_axis)
  expected = _loss_and_grads(ring.baseline_matmul_reduce_scatter, mesh,
                             in_specs, out_spec, cotangent,
                             scatter_axis=scatter_axis)(x, w)
  actual = _loss_and_grads(ops.matmul_reduce_scatter, mesh, in_specs,
                           out_spec, cotangent, scatter_axis=scatter_axis,
                           impl=impl)(x, w)
  _assert_same_loss(actual[0], expected[0], cotangent, x.shape[-1])
  _assert_same(actual[1], expected[1], "float32")


@pytest.mark.parametrize("data,tensor", utils.MESH_SHAPES)
@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("gather_axis", [0, 1])
def test_all_gather_matmul_grads_equal_baseline_autodiff(
    rng, data, tensor, impl, gather_axis):
  mesh = utils.mesh(data, tensor)
  x, w, cotangent = _all_gather_problem(rng, data, tensor, "float32")
  in_specs, out_spec = utils.all_gather_specs(3, gather_axis)
  expected = _loss_and_grads(ring.baseline_all_gather_matmul, mesh, in_specs,
                             out_spec, cotangent,
                             gather_axis=gather_axis)(x, w)
  actual = _loss_and_grads(ops.all_gather_matmul, mesh, in_specs, out_spec,
                           cotangent, gather_axis=gather_axis,
                           impl=impl)(x, w)
  _assert_same_loss(actual[0], expected[0], cotangent, x.shape[-1])
  _assert_same(actual[1], expected[1], "float32")


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_bf16_grads_close_to_baseline_autodiff(rng, op):
  mesh = utils.mesh(2, 4)
  x, w, cotangent, in_specs, out_spec, fn, baseline, kwargs = _op_problem(
      rng, op, "bfloat16")
  expected = _loss_and_grads(baseline, mesh, in_specs, out_spec, cotangent,
                             **kwargs)(x, w)
  actual = _loss_and_grads(fn, mesh, in_specs, out_spec, cotangent,
                           impl="ring", **kwargs)(x, w)
  # Each side rounds its own partial sums to bf16: an entry that cancels to
  # near zero is off by an ulp of the largest partial, not of its spread
  # (JAX 0.12's CPU dot rounds differently from 0.10's). A misplaced or
  # missing row block is still off by the entries' own size.
  for a, e in zip(actual[1], expected[1]):
    assert a.dtype == e.dtype
    e = utils.exact(e)
    utils.assert_close_to_scale(a, e, dtype="bfloat16",
                                scale=float(np.max(np.abs(e))))


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("impl", ["ring", "baseline"])
def test_save_gathered_gives_the_same_grads(rng, op, impl):
  mesh = utils.mesh(2, 4)
  x, w, cotangent, in_specs, out_spec, fn, _, kwargs = _op_problem(
      rng, op, "float32")
  regathered, saved = (
      _loss_and_grads(fn, mesh, in_specs, out_spec, cotangent, impl=impl,
                      save_gathered=save, **kwargs)(x, w)
      for save in (False, True))
  np.testing.assert_array_equal(saved[0], regathered[0])
  for a, b in zip(saved[1], regathered[1]):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_save_gathered_compiles_one_all_gather_fewer(rng, op):
  # With the ring, the only all-gather left in forward + backward is the
  # one that re-gathers for dw; saving the gathered operand removes it and
  # adds no ring (the shards are kept as they pass).
  mesh = utils.mesh(2, 4)
  x, w, cotangent, in_specs, out_spec, fn, _, kwargs = _op_problem(
      rng, op, "float32")
  counts = {}
  for save in (False, True):
    hlo = _loss_and_grads(fn, mesh, in_specs, out_spec, cotangent,
                          impl="ring", save_gathered=save,
                          **kwargs).lower(x, w).compile().as_text()
    counts[save] = (utils.count_ops(hlo, "all-gather"),
                    utils.count_ops(hlo, "collective-permute"))
  assert counts[False][0] == counts[True][0] + 1, counts
  assert counts[False][1] == counts[True][1], counts
  # Two rings of D=4 both ways round: 2 + 1 sends each.
  assert counts[True][1] == 6, counts


def test_all_gather_backward_runs_the_reduce_scatter_ring(rng):
  # dx = reduce_scatter(dy @ w.T) through the ring, not XLA's collective.
  mesh = utils.mesh(1, 4)
  x, w, cotangent = _all_gather_problem(rng, 1, 4, "float32")
  in_specs, out_spec = utils.all_gather_specs(3, 1)
  hlo = _loss_and_grads(ops.all_gather_matmul, mesh, in_specs, out_spec,
                        cotangent, gather_axis=1, impl="ring").lower(
                            x, w).compile().as_text()
  assert utils.count_ops(hlo, "reduce-scatter") == 0
  # Forward and backward rings of D=4, both ways round: 2 + 1 sends each.
  assert utils.count_ops(hlo, "collective-permute") == 6


# A Hopper GPU, described: the plan is decided on this CPU.
H200 = selection.DeviceFacts("gpu", "NVIDIA H200", 132)


def _plan(monkeypatch, impl, forward, dtype, out_dtype=None):
  """`selection.choose`'s plan for `forward` on a problem both kernels serve
  and where they pay off (per shard 4096 x 4096 x 4096, D = 2)."""
  monkeypatch.setenv("COLLECTIVE_MATMUL_TUNING_CACHE",
                     "/nonexistent/tuning.json")
  problem = selection.Problem(
      4096, 4096, 4096, np.dtype(jnp.dtype(dtype)), 2,
      None if out_dtype is None else np.dtype(jnp.dtype(out_dtype)))
  return selection.choose(impl, forward, problem, H200)


@pytest.mark.parametrize("impl,collective,dtype,expected", [
    ("ring", "reduce_scatter", "bfloat16", "ring"),
    ("baseline", "all_gather", "bfloat16", "baseline"),
    ("pallas", "reduce_scatter", "float32", "ring"),
])
def test_backward_impl(monkeypatch, impl, collective, dtype, expected):
  """`collective`: the backward's; `dtype`: its cotangent's (the forward's
  result dtype, of bf16 operands). A `pallas` forward whose cotangent the
  kernels do not take (f32) runs its backward on the ring, so the
  backward of a kernel-served op does not fail for it."""
  forward = Collective(collective).transpose
  plan = _plan(monkeypatch, impl, forward, jnp.bfloat16, dtype)
  assert plan.impl == impl
  assert plan.backward_impl == expected
  # No kernel config: the ring's own (both ways round, the default).
  assert plan.backward_config == (ring.RingConfig() if expected == "ring"
                                  else None)


def test_backward_keeps_pallas_for_both_kernels_on_their_dtypes(monkeypatch):
  for collective in ("all_gather", "reduce_scatter"):
    for dtype in (jnp.bfloat16, jnp.float16):
      forward = Collective(collective).transpose
      for out_dtype in (None, dtype):
        plan = _plan(monkeypatch, "pallas", forward, dtype, out_dtype)
        assert plan.backward_impl == "pallas", (collective, dtype)
        assert plan.backward_config is not None
