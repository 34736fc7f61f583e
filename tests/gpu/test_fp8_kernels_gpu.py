"""Both kernels' fp8 cores on a one-device mesh (D = 1, no ring): e4m3 x
e4m3 and e5m2 x e4m3, the weight K-major ([n, k]), a per-tensor f32 scale,
against an f32 product of the same fp8 values with the output poisoned;
and the fp8 rings (D = 2 and 4, where that many Hopper GPUs are: the
all-gather forwards fp8 bytes, the reduce-scatter sums scaled partial
products in the output dtype) with the gathered shards they delivered.

Hopper's fp8 MMA does not accumulate at full f32 precision (a one-block fp8
wgmma matched f32 to about 2e-4 relative on an H200), so f32 results are
held to 1e-3; bf16 results add the bf16 rounding (~1.6e-3) and are held to
5e-3, as the bf16 kernels are.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from collective_matmul import kernels

from gpu_env import HOPPER_COUNT
from gpu_env import poison as _poison
from gpu_env import rel_error as _rel
from gpu_env import ring_mesh as _mesh

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
AG, RS = kernels.AllGatherConfig, kernels.ReduceScatterConfig
TOLERANCE = {jnp.bfloat16: 5e-3, jnp.float32: 1e-3}

CONFIGS = {
    "ag_default": AG(tile_k=128),
    "ag_m_split": AG(tile_k=128, wg_dimension="m"),
    "ag_eager_chained": AG(tile_k=128, eager_release=True, chain_tiles=True),
    # Chained off the pipeline depth (`_OffsetChain`).
    "ag_offset_chain": AG(tile_k=128, eager_release=True, chain_tiles=True,
                          max_concurrent_steps=3),
    "ag_wide_one_slot": AG(tile_k=128, tile_m=64, tile_n=256,
                           wg_dimension="m", epi_tile_m=64, epi_tile_n=256,
                           epi_slots=1, max_concurrent_steps=3,
                           chain_tiles=True),
    "rs_default": RS(tile_k=128),
    "rs_whole_tile_chained": RS(tile_k=128, epi_tile_n=128,
                                max_concurrent_steps=3, send_pieces=2,
                                chain_tiles=True),
    "rs_wide_one_slot": RS(tile_k=128, tile_m=64, tile_n=256,
                           wg_dimension="m", epi_tile_m=64, epi_tile_n=256,
                           epi_slots=1, max_concurrent_steps=3,
                           chain_tiles=True),
    # Ping-pong warpgroups (`TileConfig.pingpong`, one device only).
    "ag_pingpong_one_slot": AG(tile_k=128, pingpong=True, chain_tiles=True,
                               epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                               max_concurrent_steps=5),
    "ag_pingpong_192": AG(tile_k=128, tile_n=192, pingpong=True,
                          chain_tiles=True),
    "rs_pingpong_one_slot": RS(tile_k=128, pingpong=True, chain_tiles=True,
                               epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                               max_concurrent_steps=5),
}
# (m, k, n): k steps at and off the depths; m, n and k off the tiles
# (padded).
SHAPES = [(2048, 4096, 1024), (1000, 1600, 768), (256, 1024, 256),
          (1536, 2048, 2560)]


def _call(name, config, a, b_nk, scale, out_dtype):
  if name.startswith("ag"):
    kernel = functools.partial(kernels.all_gather_lhs_matmul,
                               weight_layout="nk")
  else:
    kernel = functools.partial(kernels.matmul_reduce_scatter, weight_layout="nk")
  with jax.set_mesh(_mesh(1)):
    return jax.jit(jax.shard_map(
        lambda a, b, s: kernel(a, b, axis_name="x", config=config, scale=s,
                               out_dtype=out_dtype),
        in_specs=(P(), P(), P()), out_specs=P(), check_vma=False))(
            a, b_nk, scale)


def _operands(keys, m, k, n, lhs_dtype):
  a = jax.random.normal(keys(), (m, k), jnp.float32).astype(lhs_dtype)
  b_nk = jax.random.normal(keys(), (n, k), jnp.float32).astype(E4M3)
  scale = jax.random.uniform(keys(), (), jnp.float32, 0.25, 4.0)
  ref = (np.asarray(a, np.float32) @ np.asarray(b_nk, np.float32).T
         * np.float32(scale))
  return a, b_nk, scale, ref


@pytest.mark.parametrize("lhs_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("m,k,n", SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp8_core_matches_the_f32_product_of_its_fp8_values(
    name, m, k, n, lhs_dtype, keys):
  a, b_nk, scale, ref = _operands(keys, m, k, n, lhs_dtype)
  _poison(m * n * 4)
  out = _call(name, CONFIGS[name], a, b_nk, scale, None)
  assert out.shape == (m, n) and out.dtype == jnp.bfloat16
  assert _rel(out, ref) < TOLERANCE[jnp.bfloat16]


# f32 epilogue slots take twice the shared memory: 3 stages.
F32_CONFIGS = {"ag": AG(tile_k=128, max_concurrent_steps=3),
               "rs": RS(tile_k=128, max_concurrent_steps=3)}


@pytest.mark.parametrize("name", sorted(F32_CONFIGS))
def test_fp8_core_gives_float32_at_the_mma_precision(name, keys):
  a, b_nk, scale, ref = _operands(keys, 1024, 2048, 512, E5M2)
  _poison(1024 * 512 * 4)
  out = _call(name, F32_CONFIGS[name], a, b_nk, scale, jnp.float32)
  assert out.dtype == jnp.float32
  assert _rel(out, ref) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize("name", ["ag_eager_chained", "rs_default"])
def test_fp8_core_is_repeatable_bit_for_bit(name, keys):
  a, b_nk, scale, _ = _operands(keys, 1536, 2048, 1024, E4M3)
  _poison(1536 * 1024 * 4)
  first = np.asarray(_call(name, CONFIGS[name], a, b_nk, scale, None),
                     np.float32)
  _poison(1536 * 1024 * 4)
  np.testing.assert_array_equal(
      np.asarray(_call(name, CONFIGS[name], a, b_nk, scale, None),
                 np.float32), first)


RING_CONFIGS = {
    "ag_tiles_send": AG(tile_k=128),
    "ag_eager_chained": AG(tile_k=128, eager_release=True, chain_tiles=True),
    "ag_k_major_senders": AG(tile_k=128, sender_sms=4, k_major_sends=True),
    # fp8's pick beside the by-rows senders (`heuristics._wide_tiles`).
    "ag_wide_one_slot_senders": AG(tile_k=128, tile_m=64, tile_n=256,
                                   wg_dimension="m", epi_tile_m=64,
                                   epi_tile_n=256, epi_slots=1,
                                   max_concurrent_steps=3, chain_tiles=True,
                                   sender_sms=4),
    "rs_default": RS(tile_k=128),
    "rs_whole_tile_chained": RS(tile_k=128, epi_tile_n=128,
                                max_concurrent_steps=3, send_pieces=2,
                                chain_tiles=True),
    # fp8's pick (`heuristics._wide_tiles`).
    "rs_wide_one_slot_pieces": RS(tile_k=128, tile_m=64, tile_n=256,
                                  wg_dimension="m", epi_tile_m=64,
                                  epi_tile_n=256, epi_slots=1,
                                  max_concurrent_steps=3, chain_tiles=True,
                                  send_pieces=4),
}


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("lhs_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name", sorted(RING_CONFIGS))
def test_fp8_ring_matches_the_f32_product_of_its_fp8_values(name, lhs_dtype,
                                                            d, keys):
  if d > HOPPER_COUNT:
    pytest.skip(f"needs {d} GPUs")
  m, k, n = 512, 2048, 768
  config = RING_CONFIGS[name]
  all_gather = name.startswith("ag")
  rows, cols = (d * m, k) if all_gather else (d * m, d * k)
  a = jax.random.normal(keys(), (rows, cols), jnp.float32).astype(lhs_dtype)
  b_nk = jax.random.normal(keys(), ((d * n if all_gather else n), cols),
                           jnp.float32).astype(E4M3)
  scale = jax.random.uniform(keys(), (), jnp.float32, 0.25, 4.0)
  ref = (np.asarray(a, np.float32) @ np.asarray(b_nk, np.float32).T
         * np.float32(scale))
  with jax.set_mesh(_mesh(d)):
    if all_gather:
      specs = (P("x", None), P("x", None), P())
      out_specs = (P(None, "x"), P("x"))
      fn = lambda a, b, s: kernels.all_gather_lhs_matmul(
          a, b, "x", config=config, weight_layout="nk", scale=s,
          return_gathered=True)
    else:
      specs = (P(None, "x"), P(None, "x"), P())
      out_specs = P("x", None)
      fn = lambda a, b, s: kernels.matmul_reduce_scatter(
          a, b, "x", config=config, weight_layout="nk", scale=s)
    operands = [jax.sharding.reshard(x, spec)
                for x, spec in zip((a, b_nk, scale), specs)]
    _poison(d * m * d * n * 4)
    out = jax.jit(jax.shard_map(fn, out_specs=out_specs,
                                check_vma=False))(*operands)
  if all_gather:
    out, held = out
    # Every device holds every shard, as fp8 bytes, in axis-index order.
    np.testing.assert_array_equal(
        np.asarray(held, np.float32).reshape(d, d * m, k),
        np.broadcast_to(np.asarray(a, np.float32), (d, d * m, k)))
  assert out.dtype == jnp.bfloat16
  # The reduce-scatter adds d partial sums, each rounded to bf16.
  assert _rel(out, ref) < TOLERANCE[jnp.bfloat16] * (1 if all_gather else 2)
