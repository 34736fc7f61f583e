"""Both kernels with row and column scales (rowwise fp8) on Hopper: each
device's rows and its weight's columns scaled in the f32 epilogue, against
the f32 product of the same fp8 values times the same scales (random and
non-uniform, so a scale read from the wrong row or column fails), outputs
poisoned. At D = 1 the fp8 cores of each kind of tile (64 x 256 one-slot,
ping-pong); at D = 2 and 4, where that many Hopper GPUs are, the rings on
devices, the all-gather's row scales gathered before the kernel. The
rings on one GPU (virtual ranks, D = 2, 4, 8): tools/rings_one_gpu.py
--only /rowwise/. Tolerances as tests/gpu/test_fp8_kernels_gpu.py's.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from collective_matmul import kernels

from cm_test_utils import ONE_SLOT_WIDE
from cm_test_utils import PINGPONG_ONE_SLOT
from gpu_env import HOPPER_COUNT
from gpu_env import poison
from gpu_env import rel_error
from gpu_env import ring_mesh

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
AG, RS = kernels.AllGatherConfig, kernels.ReduceScatterConfig
TOLERANCE = 5e-3  # bf16 results: the bf16 rounding beside the fp8 MMA's.
CORES = {
    "ag_default": AG(tile_k=128),
    "ag_wide_one_slot": AG(tile_k=128, **ONE_SLOT_WIDE),
    "ag_pingpong_one_slot": AG(tile_k=128, **PINGPONG_ONE_SLOT),
    "rs_default": RS(tile_k=128),
    "rs_wide_one_slot": RS(tile_k=128, send_pieces=4, **ONE_SLOT_WIDE),
    "rs_pingpong_one_slot": RS(tile_k=128, **PINGPONG_ONE_SLOT),
}
RINGS = {
    "ag_tiles_send": AG(tile_k=128),
    "ag_k_major_senders": AG(tile_k=128, sender_sms=4, k_major_sends=True),
    "ag_wide_one_slot_senders": AG(tile_k=128, sender_sms=4,
                                   **ONE_SLOT_WIDE),
    "rs_default": RS(tile_k=128),
    "rs_wide_one_slot_pieces": RS(tile_k=128, send_pieces=4, **ONE_SLOT_WIDE),
}


def _scales(keys, size):
  return jax.random.uniform(keys(), (size,), jnp.float32, 0.25, 4.0)


def _run(name, config, d, a, b_nk, row_scale, col_scale, scale=None):
  """The kernel over D devices: a and b_nk (and the scale vectors) sharded
  as the collective takes them."""
  extra = () if scale is None else (scale,)
  if name.startswith("ag"):
    specs = (P("x", None), P("x", None), P("x"), P("x")) + (P(),) * len(extra)
    out_spec = P(None, "x")
    kernel = kernels.all_gather_lhs_matmul
  else:
    specs = (P(None, "x"), P(None, "x"), P("x"), P("x")) + (P(),) * len(extra)
    out_spec = P("x", None)
    kernel = kernels.matmul_reduce_scatter
  with jax.set_mesh(ring_mesh(d)):
    operands = [jax.sharding.reshard(x, spec) for x, spec in
                zip((a, b_nk, row_scale, col_scale) + extra, specs)]
    return jax.jit(jax.shard_map(
        lambda a, b, r, c, *s: kernel(
            a, b, "x", config=config, weight_layout="nk", row_scale=r,
            col_scale=c, **(dict(scale=s[0]) if s else {})),
        out_specs=out_spec, check_vma=False))(*operands)


@pytest.mark.parametrize("lhs_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("m,k,n", [(2048, 4096, 1024), (1000, 1600, 768)],
                         ids=str)
@pytest.mark.parametrize("name", sorted(CORES))
def test_rowwise_core_matches_the_scaled_f32_product(name, m, k, n,
                                                     lhs_dtype, keys):
  a = jax.random.normal(keys(), (m, k), jnp.float32).astype(lhs_dtype)
  b_nk = jax.random.normal(keys(), (n, k), jnp.float32).astype(E4M3)
  row, col = _scales(keys, m), _scales(keys, n)
  ref = (np.asarray(a, np.float32) @ np.asarray(b_nk, np.float32).T
         * np.asarray(row)[:, None] * np.asarray(col)[None, :])
  poison(m * n * 4)
  out = _run(name, CORES[name], 1, a, b_nk, row, col)
  assert out.shape == (m, n) and out.dtype == jnp.bfloat16
  assert rel_error(out, ref) < TOLERANCE


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("name", sorted(RINGS))
def test_rowwise_ring_matches_the_scaled_f32_product(name, d, keys):
  """Each device's own row and column scales, with the per-tensor scale:
  the all-gather's rows of shard j scaled by device j's row scales and
  its columns by its own; the reduce-scatter's sum of each device's
  scaled partial product."""
  if d > HOPPER_COUNT:
    pytest.skip(f"needs {d} GPUs")
  m, k, n = 512, 2048, 768
  all_gather = name.startswith("ag")
  lhs_dtype = E4M3 if all_gather else E5M2
  rows, cols = (d * m, k) if all_gather else (d * m, d * k)
  a = jax.random.normal(keys(), (rows, cols), jnp.float32).astype(lhs_dtype)
  b_nk = jax.random.normal(keys(), ((d * n if all_gather else n), cols),
                           jnp.float32).astype(E4M3)
  # Device r's row scales are its slice of `row`, its column scales its
  # slice of `col`.
  row = _scales(keys, d * m if all_gather else d * d * m)
  col = _scales(keys, d * n)
  scale = jnp.float32(0.75)
  a32, b32 = np.asarray(a, np.float32), np.asarray(b_nk, np.float32)
  row, col = np.asarray(row), np.asarray(col)
  if all_gather:
    ref = a32 @ b32.T * row[:, None] * col[None, :] * 0.75
  else:
    ref = sum((a32[:, r * k:(r + 1) * k] @ b32[:, r * k:(r + 1) * k].T)
              * row[r * d * m:(r + 1) * d * m, None]
              * col[r * n:(r + 1) * n][None, :] for r in range(d)) * 0.75
  poison(d * m * d * n * 4)
  out = _run(name, RINGS[name], d, a, b_nk, jnp.asarray(row),
             jnp.asarray(col), scale)
  assert out.dtype == jnp.bfloat16
  # The reduce-scatter adds d partial sums, each rounded to bf16.
  assert rel_error(out, ref) < TOLERANCE * (1 if all_gather else 2)
