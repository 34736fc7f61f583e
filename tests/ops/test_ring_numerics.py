"""`ring` and `baseline` all_gather_matmul against a float64 reference."""
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from cm_test_utils import TOLERANCE, assert_close, max_rel_error
from cm_test_utils import mesh_1d, normal, put, reference

# (name, local x shape from D and k, gather_axis): 2-D rows, 3-D batch, 3-D seq.
LAYOUTS = {
    "2d_rows": (lambda d, k: (d * 8, k), 0),
    "3d_batch": (lambda d, k: (d * 2, 4, k), 0),
    "3d_seq": (lambda d, k: (2, d * 4, k), 1),
}
K, N_LOCAL = 64, 16


def _specs(ndim, gather_axis):
  x_spec = [None] * ndim
  x_spec[gather_axis] = "x"
  out_spec = [None] * (ndim - 1) + ["x"]
  return P(*x_spec), P(None, "x"), P(*out_spec)


def _run_ring_and_baseline(d, layout, dtype, bidirectional, keys):
  shape_fn, gather_axis = LAYOUTS[layout]
  x = normal(keys(), shape_fn(d, K), dtype)
  w = normal(keys(), (K, d * N_LOCAL), dtype)
  x_spec, w_spec, out_spec = _specs(x.ndim, gather_axis)

  def body(x, w):
    op = functools.partial(cm.all_gather_matmul, x, w, "x",
                           gather_axis=gather_axis,
                           bidirectional=bidirectional)
    return op(impl="ring"), op(impl="baseline")

  mesh = mesh_1d(d)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec),
                            out_specs=(out_spec, out_spec)))
  ring, base = f(put(x, mesh, x_spec), put(w, mesh, w_spec))
  return x, w, ring, base


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("bidirectional", [True, False],
                         ids=["bidir", "unidir"])
@pytest.mark.parametrize("d", [1, 2, 4, 8])
def test_ring_and_baseline_match_reference(d, bidirectional, layout, dtype,
                                           keys):
  x, w, ring, base = _run_ring_and_baseline(d, layout, dtype, bidirectional,
                                            keys)
  ref = reference(x, w)
  assert ring.dtype == base.dtype == jnp.dtype(dtype)
  assert_close(ring, ref, TOLERANCE[dtype])
  assert_close(base, ref, TOLERANCE[dtype])
  # Same products, possibly differently associated: ring ~ baseline.
  assert_close(ring, np.asarray(base, np.float64), TOLERANCE[dtype])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_tolerance_catches_swapped_blocks(layout, keys):
  """The bf16 check is tight enough to see two output blocks exchanged."""
  d = 4
  x, w, ring, _ = _run_ring_and_baseline(d, layout, "bfloat16", True, keys)
  ref = reference(x, w)
  assert_close(ring, ref, TOLERANCE["bfloat16"])  # Correct as computed.
  gather_axis = LAYOUTS[layout][1]
  rows = x.shape[gather_axis] // d
  out = np.asarray(ring, np.float32)
  swapped = out.copy()
  block = lambda i: (slice(None),) * gather_axis + (
      slice(i * rows, (i + 1) * rows),)
  swapped[block(1)], swapped[block(2)] = out[block(2)], out[block(1)]
  assert max_rel_error(swapped, ref) > TOLERANCE["bfloat16"]
  with pytest.raises(AssertionError):
    assert_close(swapped, ref, TOLERANCE["bfloat16"])


def test_ring_uses_only_neighbour_permutes_not_all_gather(keys):
  """The ring's program moves shards with collective-permutes only."""
  d = 4
  x = normal(keys(), (d * 8, K), jnp.float32)
  w = normal(keys(), (K, d * N_LOCAL), jnp.float32)
  mesh = mesh_1d(d)
  x, w = put(x, mesh, P("x", None)), put(w, mesh, P(None, "x"))
  texts = {}
  for impl in ("ring", "baseline"):
    f = jax.jit(jax.shard_map(
        functools.partial(cm.all_gather_matmul, axis_name="x", impl=impl),
        mesh=mesh, in_specs=(P("x", None), P(None, "x")),
        out_specs=P(None, "x")))
    texts[impl] = f.lower(x, w).compile().as_text()
  assert "all-gather" not in texts["ring"]
  assert "collective-permute" in texts["ring"]
  assert "all-gather" in texts["baseline"]
