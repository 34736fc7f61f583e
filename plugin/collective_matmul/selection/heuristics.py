"""The kernels' configs where nothing measured applies: what is tried
(`tile_candidates`) and how one is picked for a problem.

Each rule states its mechanism; where its thresholds come from (the
measurements, per rule) is in docs/TUNING.md, whose sections are named after
the constants here.
"""
from __future__ import annotations

import dataclasses

from collective_matmul.enums import MatmulDimension
from collective_matmul.kernels.configs import AllGatherConfig
from collective_matmul.kernels.configs import FP8_TILE_K
from collective_matmul.kernels.configs import ReduceScatterConfig
from collective_matmul.kernels.configs import TileConfig
from collective_matmul.kernels.schedule import padding
from collective_matmul.selection.applicability import tiles_per_step
from collective_matmul.selection.problem import Problem


def tile_candidates(problem: Problem | None = None):
  """The tile shapes the heuristic (and autotuning) choose from; for an fp8
  `problem` with the k step its operands need (`FP8_TILE_K`: 8-bit wgmma
  operands are read K-major through a 128-byte swizzle)."""
  m, n = MatmulDimension.M, MatmulDimension.N
  tile_k = {"tile_k": FP8_TILE_K} if problem is not None and (
      problem.is_fp8) else {}
  for tile_m, tile_n, wg in ((128, 128, n), (128, 128, m), (128, 64, n),
                             (64, 128, n), (64, 64, n)):
    yield AllGatherConfig(tile_m=tile_m, tile_n=tile_n, wg_dimension=wg,
                          epi_tile_m=64, epi_tile_n=64, **tile_k)


def _tiles(problem: Problem, num_sms: int) -> AllGatherConfig:
  """The largest CTA tile that needs the least padding and still gives at
  least half the SMs work across the ring, with as many pipeline stages as
  fit."""
  m, k, n = problem.rows, problem.k, problem.n

  def score(cfg: AllGatherConfig):
    pad = padding(cfg, m, k, n)
    waste = ((m + pad.m) * (n + pad.n)) / (m * n) - 1
    tiles = problem.axis_size * tiles_per_step(cfg, problem)
    underfill = max(0.0, 1 - tiles / (num_sms / 2))
    area = cfg.cta_tile_m * cfg.cta_tile_n
    return (round(waste + underfill, 3), -area,
            cfg.wg_dimension != MatmulDimension.N)

  fitting = [c for c in (c.fit_shared_memory(*problem.itemsizes)
                         for c in tile_candidates(problem)) if c is not None]
  return min(fitting, key=score)


def all_gather_config(problem: Problem, num_sms: int, pingpong: bool = True,
                      wide_tiles: bool = True) -> AllGatherConfig:
  """The all-gather kernel's heuristic config for `problem` (local shards
  rows x k and k x n): `_tiles`, then dedicated senders (`_sender_config`),
  chained tiles (`_chained`) and, where they help, if `wide_tiles`, one-slot
  64 x 256 warpgroup tiles (`_wide_tiles`) and, if `pingpong`, ping-pong
  warpgroups (`_pingpong_tiles`)."""
  base = _tiles(problem, num_sms)
  config = _chained(_sender_config(base, problem, num_sms) or base, problem)
  if wide_tiles:
    config = _wide_tiles(config, problem)
  return _pingpong_tiles(config, problem, num_sms) if pingpong else config


def reduce_scatter_config(problem: Problem, num_sms: int,
                          pingpong: bool = True,
                          wide_tiles: bool = True) -> ReduceScatterConfig:
  """The reduce-scatter kernel's heuristic config: `_reduce_scatter_tiles`,
  then, where they help, if `wide_tiles`, one-slot 64 x 256 warpgroup
  tiles (`_wide_tiles`) and, if `pingpong`, ping-pong warpgroups
  (`_pingpong_tiles`)."""
  config = _reduce_scatter_tiles(problem, num_sms)
  if wide_tiles:
    config = _wide_tiles(config, problem)
  return _pingpong_tiles(config, problem, num_sms) if pingpong else config


def _reduce_scatter_tiles(problem: Problem,
                          num_sms: int) -> ReduceScatterConfig:
  """`_tiles` with the epilogue and send pacing the reduce-scatter kernel
  wants (rows: after the scatter).

  Its epilogue stores each tile's partial sum to the next device. With the
  whole warpgroup tile in two epilogue slots (epi tile = half the tile) an
  epilogue never waits for NVLink to drain a slot, and the stores overlap
  the next tile's main loop; the shared memory comes from one pipeline
  stage (the kernel does not forward from its pipeline, so it releases
  slots without delay and 3 stages prefetch as deep as the all-gather's 4).
  Kept as tiled when a wider epilogue would leave fewer than 3 stages.

  Send pacing: with D = 2 and a ring step's tiles in one wave, every SM
  stores its partial sum at the same moment, and 4 row pieces 6 steps apart
  keep each remote store short; over several waves, and at D > 2, 2 pieces
  12 apart.
  """
  tiles = _tiles(problem, num_sms)
  if _steps_in_one_wave(tiles, problem, num_sms):
    # Smaller tiles, so a step's partial sums move while the next computes.
    tiles = _one_round_tiles(tiles, problem, num_sms) or tiles
  base = ReduceScatterConfig(**tiles.tile_fields())
  if base.tile_m % 2 or (base.tile_m // 2) % 64:
    return base
  one_wave = tiles_per_step(base, problem) <= num_sms
  pieces, gap = ((4, 6) if problem.axis_size == 2 and one_wave
                 else (2, 12))
  wide = dataclasses.replace(
      base, epi_tile_m=base.tile_m // 2, epi_tile_n=base.tile_n,
      send_gap=gap, send_pieces=pieces).fit_shared_memory(
          *problem.itemsizes)
  if wide is None or wide.max_concurrent_steps < 3:
    return base
  return wide


# Local n up to which a block's tiles share one pipeline with the tiles'
# own sends released in their k step (`eager_release`, `chain_tiles`), at
# D = 2; wider, the eager release costs more than the chaining saves.
CHAIN_EAGER_MAX_N = 4096


def _chained(config: AllGatherConfig, problem: Problem) -> AllGatherConfig:
  """`config` with a block's tiles on one pipeline (`chain_tiles`) at D = 2,
  so the next tile's first k blocks load during this one's last steps and
  epilogue:

  * with the balanced dedicated senders (by rows, several waves per step),
    also where the pipeline's steps are no multiple of its depth
    (the kernels then chain with an offset);
  * with the tiles' own sends released in their k step (`eager_release`),
    up to `CHAIN_EAGER_MAX_N` columns and where the k steps are a multiple
    of the pipeline depth.

  Not with k-major senders: each SM runs one tile per ring step there, so
  there is no next tile to start early.
  """
  if problem.axis_size != 2:
    return config
  if config.sender_sms and not config.k_major_sends:
    return dataclasses.replace(config, chain_tiles=True)
  k = problem.k
  k_iters = (k + padding(config, 0, k, 0).k) // config.tile_k
  if (not config.sender_sms and problem.n <= CHAIN_EAGER_MAX_N
      and k_iters % config.max_concurrent_steps == 0):
    return dataclasses.replace(config, eager_release=True, chain_tiles=True)
  return config


# `_wide_tiles`: each compute warpgroup's tile and the one epilogue slot
# that holds it, where the CTA tile is 128 x 256.
WIDE_TILE = (64, 256)
# The pipeline stages it needs (as many as fit with bf16 results).
WIDE_MIN_STAGES = 3


def _wide_tiles(config, problem: Problem):
  """A 128 x 256 CTA tile split along m (each compute warpgroup 64 x 256,
  `WIDE_TILE`) with its whole tile in one epilogue slot (`epi_slots=1`),
  chained, instead of along n (128 x 128 each) through two slots; where a
  ring's schedule is unchanged by it. bf16 and fp8 alike.

  The excess over cuBLAS is the epilogue and the gap to the next tile (the
  k loop runs at the tensor cores' peak), and fp8 halves the k loop but not
  the epilogue: the one-slot epilogue is one cast and one store per
  warpgroup tile, with no wait for a slot, and chaining loads the next
  tile's first k blocks under it. Same CTA tile, so the same tiles per
  step, padding and senders. Its shared memory leaves 3 pipeline stages
  with bf16 results (`WIDE_MIN_STAGES`; 2 with f32 results, which keep
  `config`):
  * all-gather: taken where the pipeline releases its slots at once (one
    device, or the dedicated senders by rows). Tiles that forward k blocks
    from their slots (released a step late) would lose a stage of
    prefetch, and the k-major senders run one tile per SM and ring step
    (nothing to chain): those keep `config`;
  * reduce-scatter: its pick (the whole tile in two slots) already has 3
    stages; the one slot leaves in twice the row pieces, so the previous
    tile's partial sum still leaves in as many stores of the same size at
    the same k steps.
  Where 192-wide ping-pong tiles fit n (`_pingpong_tiles`, applied after)
  they replace it.
  """
  if (config.cta_tile_m, config.cta_tile_n,
      config.wg_dimension) != (128, 256, MatmulDimension.N):
    return config
  tile_m, tile_n = WIDE_TILE
  fields = dict(tile_m=tile_m, tile_n=tile_n, wg_dimension=MatmulDimension.M,
                epi_tile_m=tile_m, epi_tile_n=tile_n, epi_slots=1,
                chain_tiles=True)
  if isinstance(config, ReduceScatterConfig):
    if (config.epi_tile_m, config.epi_tile_n) != (config.tile_m // 2,
                                                  config.tile_n):
      return config  # Not the whole tile in two slots.
    fields["send_pieces"] = 2 * config.send_pieces
  elif problem.axis_size != 1 and not (config.sender_sms
                                       and not config.k_major_sends):
    return config
  try:
    wide = dataclasses.replace(config, **fields)
  except ValueError:  # Row pieces below 8 rows.
    return config
  wide = wide.fit_shared_memory(*problem.itemsizes)
  if wide is None or wide.max_concurrent_steps < WIDE_MIN_STAGES:
    return config  # f32 results: the one slot leaves too few stages.
  return wide


# Ping-pong warpgroups (`_pingpong_tiles`): the CTA tile each compute
# warpgroup runs whole, in turn with the other.
PINGPONG_TILE = (128, 192)
# The most of n the last column tile may leave idle: 192-wide tiles leave
# 3.1 % at n = 2048 and 4096 (where ping-pong lost or tied), 0-1.8 % at
# n = 3072, 5504, 6144, 7168 and 14336 (where it won).
PINGPONG_MAX_COLUMN_WASTE = 0.02
# Tiles of the whole ring per SM at least (ping-pong lost at 2048 rows,
# 2.7 tiles per SM; won at 16384 rows, 10.7 and more).
PINGPONG_MIN_TILES_PER_SM = 8
# Pipeline stages it needs (as measured; fewer do not hide the epilogue).
PINGPONG_STAGES = 4


def _pingpong_tiles(config, problem: Problem, num_sms: int):
  """Ping-pong warpgroups on `PINGPONG_TILE` tiles (`TileConfig.pingpong`)
  in place of `config`'s tiles where they help; the ring's schedule kept.

  Each warpgroup runs a whole tile, k loop and epilogue, while the other
  runs the next tile's k loop, so the epilogue no longer stalls the tensor
  cores (the excess over cuBLAS is the epilogue and the gap to the next
  tile). Taken where the 192-wide column tiles leave little of n idle
  (`PINGPONG_MAX_COLUMN_WASTE`) and the ring has enough tiles for both
  warpgroups of every SM (`PINGPONG_MIN_TILES_PER_SM`), with two 64 x 64
  epilogue slots:
  * all-gather: its tiles must free each slot at once where they forward
    from it (`configs.axis_reason`): kept where the config has the
    dedicated senders by rows or releases eagerly (or runs on one device);
    with neither at D = 2 (wide n, beyond the balanced senders) the eager
    release is turned on, predicted to cost less than ping-pong saves
    there (docs/TUNING.md; no ring with it timed); with k-major senders
    each SM runs one tile per ring step, so the config is kept;
  * reduce-scatter: the partial sums leave in stores of the size the
    config's pacing had (`send_pieces` per epilogue tile), at the same
    k steps apart.
  """
  tile_m, tile_n = PINGPONG_TILE
  n = problem.n
  if -(-n // tile_n) * tile_n > n * (1 + PINGPONG_MAX_COLUMN_WASTE):
    return config
  fields = dict(tile_m=tile_m, tile_n=tile_n, wg_dimension=MatmulDimension.N,
                epi_tile_m=64, epi_tile_n=64, epi_slots=2, chain_tiles=True,
                pingpong=True, max_concurrent_steps=PINGPONG_STAGES)
  if isinstance(config, ReduceScatterConfig):
    store = (config.epi_tile_m // config.send_pieces) * config.epi_tile_n
    fields["send_pieces"] = max(1, (64 * 64) // store)
  elif config.sender_sms and config.k_major_sends:
    return config
  elif not config.sender_sms and not config.eager_release:
    if problem.axis_size > 2:
      return config
    fields["eager_release"] = True
  try:
    pingpong = dataclasses.replace(config, **fields)
  except ValueError:  # Row pieces that do not split the epilogue tile.
    return config
  pingpong = pingpong.fit_shared_memory(*problem.itemsizes)
  if pingpong is None or pingpong.max_concurrent_steps < PINGPONG_STAGES:
    return config  # Fewer stages than were measured (dedicated senders).
  tiles = problem.axis_size * tiles_per_step(pingpong, problem)
  if tiles < PINGPONG_MIN_TILES_PER_SM * num_sms:
    return config
  return pingpong


# Sender blocks of the dedicated-sender schedule (`AllGatherConfig.sender_sms`).
SENDER_SMS = 4
# Where all ring steps' tiles run at once and leave more SMs idle than
# `SENDER_SMS`, the senders take the idle SMs, up to this many (each moves
# a few tens of GB/s, so more senders deliver the shard sooner).
SENDER_MAX_IDLE_SMS = 16
# Several waves per step: the balanced senders deliver each row block in
# time where a step's GEMM (2 m k n flops) and the shard's transfer (m k
# elements) take about as long, a ratio of n alone: local n in this range,
# with at least `SENDER_BALANCED_MIN_M` rows per shard.
SENDER_BALANCED_N = (4096, 8192)
SENDER_BALANCED_MIN_M = 4096
# One wave per step (D = 2): k-major senders only from this local n on,
# where a step's GEMM lasts long enough for the senders to deliver the
# shard within two steps.
SENDER_K_MAJOR_MIN_N = 4096
# Where all ring steps are one wave the senders' transfer is the critical
# path: 128-column k steps (the senders copy 256-byte rows) with at least
# `SENDER_WIDE_MIN_STAGES` pipeline stages.
SENDER_WIDE_TILE_K = 128
SENDER_WIDE_MIN_STAGES = 3


def _sender_config(base: AllGatherConfig, problem: Problem,
                   num_sms: int) -> AllGatherConfig | None:
  """The dedicated-sender schedule where it helps, else None.

  All ring steps in one wave: the remote tiles would sit idle until sends
  paced through the local tiles' k loops delivered their rows. Instead
  `SENDER_SMS` (up to `SENDER_MAX_IDLE_SMS` idle) blocks only send, k-major
  (a remote tile starts as soon as the first k group is in), and the
  largest CTA tile (>= 128 rows) whose ring step fills the other SMs once
  lets each SM run its local tile while its remote rows arrive; with
  `SENDER_WIDE_TILE_K` where that fits.

  One wave per step (from `SENDER_K_MAJOR_MIN_N` columns, D = 2): the same
  k-major senders beside `base`'s tiles: the next step's tiles start at
  once and the senders need only stay ahead of their k loops.

  Several waves per step (`SENDER_BALANCED_N`, `SENDER_BALANCED_MIN_M`,
  D = 2): row-major senders deliver each row block in time and the other
  SMs compute without sends in their k loops. Below that range the transfer
  outlasts a step; above it the senders' SMs are missed.
  """
  axis_size, n = problem.axis_size, problem.n
  if _steps_in_one_wave(base, problem, num_sms):
    tiles = _one_round_tiles(base, problem, num_sms - SENDER_SMS)
    if tiles is None:  # `base` already fills the most SMs it can.
      tiles = base
    idle = num_sms - axis_size * tiles_per_step(tiles, problem)
    if tiles is base and idle < SENDER_SMS:
      # The senders would push tiles into a second wave: no senders.
      return None
    senders = dataclasses.replace(
        tiles, sender_sms=max(SENDER_SMS, min(idle, SENDER_MAX_IDLE_SMS)),
        k_major_sends=True)
    wide = wide_sender_tiles(senders, *problem.itemsizes)
    if wide is not None and problem.k % SENDER_WIDE_TILE_K == 0:
      return wide
    return senders.fit_shared_memory(*problem.itemsizes)
  if (axis_size == 2 and n >= SENDER_K_MAJOR_MIN_N
      and tiles_per_step(base, problem) <= num_sms - SENDER_SMS):
    return dataclasses.replace(
        base, sender_sms=SENDER_SMS,
        k_major_sends=True).fit_shared_memory(*problem.itemsizes)
  low, high = SENDER_BALANCED_N
  if (axis_size == 2 and low <= n <= high
      and problem.rows >= SENDER_BALANCED_MIN_M):
    return dataclasses.replace(
        base, sender_sms=SENDER_SMS).fit_shared_memory(*problem.itemsizes)
  return None


def wide_sender_tiles(config: AllGatherConfig, itemsize: int,
                      out_itemsize: int) -> AllGatherConfig | None:
  """`config` with the k step `SENDER_WIDE_TILE_K`, if at least
  `SENDER_WIDE_MIN_STAGES` pipeline stages of it fit with operands and
  results of these element sizes (bytes), else None."""
  wide = dataclasses.replace(
      config, tile_k=SENDER_WIDE_TILE_K).fit_shared_memory(itemsize,
                                                           out_itemsize)
  if wide is None or wide.max_concurrent_steps < SENDER_WIDE_MIN_STAGES:
    return None
  return wide


def _steps_in_one_wave(config: TileConfig, problem: Problem,
                       num_sms: int) -> bool:
  """At D = 2, whether all ring steps' tiles of `config` run in one wave: a
  remote tile then waits idle for data that its peer produces (the
  all-gather's rows, the reduce-scatter's partial sum) in a tile running at
  the same time."""
  return problem.axis_size == 2 and 2 * tiles_per_step(config, problem) <= (
      num_sms)


def _one_round_tiles(base: TileConfig, problem: Problem,
                     blocks: int) -> AllGatherConfig | None:
  """The tiles (>= 128 rows) whose ring step fills the most of `blocks` SMs
  (ties in `tile_candidates` order), if that is more tiles per step than
  `base` has, else None: each SM then runs one tile of each step in turn,
  and a step's data moves while the previous step computes."""
  fitting = [c for c in (t.fit_shared_memory(*problem.itemsizes)
                         for t in tile_candidates(problem))
             if c is not None and c.cta_tile_m >= 128
             and tiles_per_step(c, problem) <= blocks]
  if not fitting:
    return None
  best = max(fitting, key=lambda c: tiles_per_step(c, problem))
  more = tiles_per_step(best, problem) > tiles_per_step(base, problem)
  return best if more else None
