"""`ring_matmul_reduce_scatter` against `psum_scatter(x @ w)` and numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from collective_matmul import ring
import cm_test_utils as utils


def _operands(rng, data, tensor, ndim, scatter_axis, dtype):
  """Global x[B, (S,) F] and w[F, E], sized so every split is even."""
  rows = 2 * data * tensor
  shape = [rows, 3 * tensor][:ndim - 1] + [4 * tensor]
  if ndim == 3 and scatter_axis == 0:
    shape[1] = 3
  x = utils.cast(rng.standard_normal(shape), dtype)
  w = utils.cast(rng.standard_normal((4 * tensor, 5)), dtype)
  return x, w


@pytest.mark.parametrize("data,tensor", utils.MESH_SHAPES)
@pytest.mark.parametrize("ndim,scatter_axis", [(2, 0), (3, 0), (3, 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ring_equals_baseline_and_numpy(rng, data, tensor, ndim,
                                        scatter_axis, dtype):
  mesh = utils.mesh(data, tensor)
  x, w = _operands(rng, data, tensor, ndim, scatter_axis, dtype)
  in_specs, out_spec = utils.reduce_scatter_specs(ndim, scatter_axis)
  expected = utils.exact(x) @ utils.exact(w)
  for fn, kwargs in ((ring.baseline_matmul_reduce_scatter, {}),
                     (ring.ring_matmul_reduce_scatter, {}),
                     (ring.ring_matmul_reduce_scatter,
                      {"bidirectional": False})):
    out = utils.sharded(fn, mesh, in_specs, out_spec,
                        scatter_axis=scatter_axis, **kwargs)(x, w)
    assert out.dtype == jnp.dtype(dtype), (fn.__name__, kwargs)
    utils.assert_close_to_scale(out, expected, dtype=dtype)


@pytest.mark.parametrize("tensor", [3, 5])
def test_odd_rings_sum_every_block_once(rng, tensor):
  # Odd D: the two directions carry the same number of hops.
  mesh = jax.make_mesh((tensor,), ("tensor",),
                       devices=jax.devices()[:tensor],
                       axis_types=(jax.sharding.AxisType.Auto,))
  x = utils.cast(rng.standard_normal((2 * tensor, 4 * tensor)), "float32")
  w = utils.cast(rng.standard_normal((4 * tensor, 3)), "float32")
  P = jax.sharding.PartitionSpec
  out = utils.sharded(ring.ring_matmul_reduce_scatter, mesh,
                      (P(None, "tensor"), P("tensor", None)),
                      P("tensor", None))(x, w)
  utils.assert_close_to_scale(out, utils.exact(x) @ utils.exact(w),
                              dtype="float32")


@pytest.mark.parametrize("bidirectional", [True, False])
def test_ring_sums_bf16_partial_products_in_f32(rng, bidirectional):
  # Rounded once at the end: within half a bf16 ulp of the exact sum of the
  # bf16 operands' products, where a bf16 sum of 8 terms is not.
  mesh = utils.mesh(1, 8)
  x = utils.cast(rng.standard_normal((16, 64)), "bfloat16")
  w = utils.cast(rng.standard_normal((64, 32)), "bfloat16")
  in_specs, out_spec = utils.reduce_scatter_specs(2, 0)
  out = utils.sharded(ring.ring_matmul_reduce_scatter, mesh, in_specs,
                      out_spec, bidirectional=bidirectional)(x, w)
  expected = utils.exact(x) @ utils.exact(w)
  error = np.abs(utils.exact(out) - expected)
  assert np.all(error <= 2.0**-8 * np.abs(expected) + 1e-5), error.max()


def test_preferred_element_type_sets_result_dtype(rng):
  mesh = utils.mesh(1, 4)
  x = utils.cast(rng.standard_normal((8, 16)), "bfloat16")
  w = utils.cast(rng.standard_normal((16, 4)), "bfloat16")
  in_specs, out_spec = utils.reduce_scatter_specs(2, 0)
  for fn in (ring.ring_matmul_reduce_scatter,
             ring.baseline_matmul_reduce_scatter):
    out = utils.sharded(fn, mesh, in_specs, out_spec,
                        preferred_element_type=jnp.float32)(x, w)
    assert out.dtype == jnp.float32
    utils.assert_close_to_scale(out, utils.exact(x) @ utils.exact(w),
                                dtype="bfloat16")


def test_rows_not_divisible_by_axis_size_is_rejected(rng):
  mesh = utils.mesh(1, 4)
  x = utils.cast(rng.standard_normal((6, 16)), "float32")
  w = utils.cast(rng.standard_normal((16, 4)), "float32")
  P = jax.sharding.PartitionSpec
  f = utils.sharded(ring.ring_matmul_reduce_scatter, mesh,
                    (P(None, "tensor"), P("tensor", None)), P("tensor"))
  with pytest.raises(ValueError, match="size 6 does not split into 4"):
    f(x, w)
