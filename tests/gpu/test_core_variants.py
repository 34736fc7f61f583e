"""Opt-in core variants of both kernels, on a one-device mesh, against an
f32 reference with the output poisoned, twice, bit for bit: one-slot
epilogues (`TileConfig.epi_slots`) and ping-pong warpgroups
(`TileConfig.pingpong`, D = 1 only)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from collective_matmul import kernels

from gpu_env import poison as _poison
from gpu_env import rel_error as _rel
from gpu_env import ring_mesh as _mesh

AG, RS = kernels.AllGatherConfig, kernels.ReduceScatterConfig
CONFIGS = {
    # One epilogue slot per warpgroup, the whole warpgroup tile.
    "ag_one_slot": AG(epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                      max_concurrent_steps=3, chain_tiles=True),
    "ag_one_slot_wide": AG(tile_m=64, tile_n=256, wg_dimension="m",
                           epi_tile_m=64, epi_tile_n=256, epi_slots=1,
                           max_concurrent_steps=3, chain_tiles=True),
    "rs_one_slot": RS(epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                      max_concurrent_steps=3, send_pieces=2),
    "rs_one_slot_wide": RS(tile_m=64, tile_n=256, wg_dimension="m",
                           epi_tile_m=64, epi_tile_n=256, epi_slots=1,
                           max_concurrent_steps=3, send_pieces=2,
                           chain_tiles=True),
    # Ping-pong warpgroups: whole 128 x n tiles, alternating.
    "ag_pingpong": AG(pingpong=True, chain_tiles=True,
                      max_concurrent_steps=6),
    "ag_pingpong_one_slot": AG(pingpong=True, chain_tiles=True,
                               epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                               max_concurrent_steps=5),
    "ag_pingpong_192": AG(tile_n=192, pingpong=True, chain_tiles=True),
    "rs_pingpong_one_slot": RS(pingpong=True, chain_tiles=True,
                               epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                               max_concurrent_steps=5),
}
# (m, k, n): k steps at and off the depths; m and n off the CTA tile
# (padded); a grid with fewer tiles than blocks.
SHAPES = [(2048, 4096, 1024), (1000, 1600, 768), (256, 1024, 256),
          (1536, 2048, 2560)]


def _call(name, config, a, b):
  kernel = (kernels.all_gather_lhs_matmul if name.startswith("ag")
            else kernels.matmul_reduce_scatter)
  with jax.set_mesh(_mesh(1)):
    return jax.jit(jax.shard_map(
        functools.partial(kernel, axis_name="x", config=config),
        in_specs=(P(), P()), out_specs=P(), check_vma=False))(a, b)


@pytest.mark.parametrize("m,k,n", SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_core_variant_is_exact_and_repeatable(name, m, k, n):
  config = CONFIGS[name]
  key = jax.random.key(m + 3 * k + 7 * n)
  a = jax.random.normal(key, (m, k), jnp.bfloat16)
  b = jax.random.normal(jax.random.fold_in(key, 1), (k, n), jnp.bfloat16)
  ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  _poison(m * n * 4)
  first = np.asarray(_call(name, config, a, b), np.float32)
  assert first.shape == (m, n)
  assert _rel(first, ref) < 1e-2
  _poison(m * n * 4)
  np.testing.assert_array_equal(
      np.asarray(_call(name, config, a, b), np.float32), first)
