"""`kernels.trace_warpgroups` on Hopper: traced kernels give the untraced
results, bit for bit, and every tile's k loop and epilogue is in the trace
(read back with tools/warpgroup_trace.py)."""
import functools
import glob

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from collective_matmul import kernels

from cm_test_utils import import_script
from gpu_env import HOPPER_COUNT
from gpu_env import poison as _poison
from gpu_env import rel_error as _rel
from gpu_env import ring_mesh as _mesh

# (kernel, config, lhs spec, rhs spec, out spec, lhs shape, rhs shape) per
# shard count d; m = 512 rows per shard, k = 1024, n = 1024 (AG: per shard).
def _cases(d):
  m, k, n = 512, 1024, 1024
  ag = kernels.AllGatherConfig(eager_release=True, chain_tiles=True)
  rs = kernels.ReduceScatterConfig(epi_tile_n=128, send_pieces=2,
                                   max_concurrent_steps=3)
  return [
      ("all_gather", kernels.all_gather_lhs_matmul, ag, P("x", None),
       P(None, "x"), P(None, "x"), (d * m, k), (k, d * n),
       d * (m // ag.cta_tile_m) * (n // ag.cta_tile_n)),
      ("reduce_scatter", kernels.matmul_reduce_scatter, rs, P(None, "x"),
       P("x", None), P("x", None), (d * m, d * k), (d * k, n),
       d * (m // rs.cta_tile_m) * (n // rs.cta_tile_n)),
  ]


@pytest.mark.parametrize("case", ["all_gather", "reduce_scatter"])
def test_traced_kernels_are_exact_and_trace_every_tile(case, tmp_path):
  d = min(2, HOPPER_COUNT)
  mesh = _mesh(d)
  [(_, kernel, config, a_spec, b_spec, out_spec, a_shape, b_shape,
    tiles)] = [c for c in _cases(d) if c[0] == case]
  with jax.set_mesh(mesh):
    a = jax.sharding.reshard(
        jax.random.normal(jax.random.key(0), a_shape, jnp.bfloat16), a_spec)
    b = jax.sharding.reshard(
        jax.random.normal(jax.random.key(1), b_shape, jnp.bfloat16), b_spec)

    def build():
      return jax.jit(jax.shard_map(
          functools.partial(kernel, axis_name="x", config=config),
          out_specs=out_spec, check_vma=False))

    _poison(a_shape[0] * b_shape[1] * 4)
    plain = np.asarray(build()(a, b), np.float32)
    with kernels.trace_warpgroups(tmp_path, ranges_per_warpgroup=32):
      traced_fn = build()
      _poison(a_shape[0] * b_shape[1] * 4)
      traced = np.asarray(traced_fn(a, b), np.float32)
    jax.effects_barrier()
  ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  if case == "reduce_scatter":
    assert _rel(plain, ref) < 2e-2
  else:
    assert _rel(plain, ref) < 1e-2
  np.testing.assert_array_equal(traced, plain)
  files = sorted(glob.glob(str(tmp_path / "*-trace.json")))
  # One per device's kernel, or (JAX 0.11: one file name per kernel, the
  # first device's written) one.
  assert 1 <= len(files) <= d
  wt = import_script("warpgroup_trace")
  for path in files:
    s = wt.summarize(wt.load(path))
    # Every tile of every ring step, on compute warpgroup 0 of some block.
    assert s["tiles"] == tiles
    assert s["median_cycles"]["mma"] > 0 and s["median_cycles"]["epilogue"] > 0
    # A later ring step's tile waits for the shard (all-gather) or the
    # partial sum (reduce-scatter) from the previous device, once.
    wait = "wait_arrival" if case == "all_gather" else "wait_partial_sum"
    assert s["ranges"].get(wait, 0) == tiles * (d - 1) // d
