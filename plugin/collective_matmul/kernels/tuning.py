"""Tile configurations and the kernel's schedule arithmetic, in pure Python.

Nothing here imports Pallas, so config selection, applicability checks and
the ring schedule are unit-tested on CPU and usable by the override to decide
(identically on every process) whether the Hopper kernel applies.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import numpy as np

HOPPER_DEVICE_KINDS = ("H100", "H200", "H800", "H20", "GH200")
KERNEL_DTYPES = ("bfloat16", "float16")
SMEM_BYTES = 232_448  # Per-block shared memory on sm_90.
SMEM_RESERVE = 1024  # Barriers and bookkeeping.


@dataclasses.dataclass(frozen=True)
class AllGatherMatmulConfig:
  """Tiling of the all-gather-LHS matmul kernel.

  Attributes:
    tile_m, tile_n, tile_k: one compute warpgroup's output tile and the k
      step of the pipeline.
    max_concurrent_steps: shared-memory pipeline depth (>= 2).
    wg_dimension: "n" or "m": the two compute warpgroups split the CTA tile
      along this dimension (so the CTA tile is 2x tile along it).
    grid_minor_dim, grid_tile_width: order of output tiles within one ring
      step (planar snake, for L2 reuse).
    epi_tile_m, epi_tile_n: epilogue store granularity.
    spread_sends: all-gather kernel: every n-tile of a row block forwards
      its own slice of k, first thing in its pipeline, so a whole block
      reaches the next device in a fraction of a tile's time (instead of
      only at the end of the block's first tile). Reduce-scatter kernel:
      a tile's partial sum is sent during the next tile's k loop, one
      epilogue slot every `send_gap` steps, instead of all at once from its
      epilogue (needs the whole tile in the two slots, see
      `select_reduce_scatter_config`).
    loopback_for_timing: diagnostics only, WRONG RESULTS for D > 1: every
      device forwards to its own scratch instead of its neighbour's, so the
      kernel does the same work without NVLink traffic (to time what the
      link costs).
    send_gap: pipeline steps between two sends of one tile. A send holds its
      shared-memory slot until NVLink has read it; with every SM sending at
      once, back-to-back sends would stall the pipeline on the link.
    send_pieces: reduce-scatter kernel: each epilogue slot of a partial sum
      leaves in this many row pieces, `send_gap` steps apart, so that no
      store holds the SM's TMA unit long (a multiple-of-8-row split of
      `epi_tile_m`).
    early_announce: reduce-scatter kernel: signal a partial sum's arrival
      `send_gap` steps after its last send, inside the next tile's k loop
      (`partial_announce_step`), instead of after that loop, so the peer's
      epilogue finds it landed rather than waiting for a loop that ends at
      the same moment as its own.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int = 4
  wg_dimension: str = "n"
  grid_minor_dim: str = "m"
  grid_tile_width: int = 8
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  spread_sends: bool = True
  send_gap: int = 12
  send_pieces: int = 1
  early_announce: bool = True
  loopback_for_timing: bool = False

  def __post_init__(self):
    for name in ("tile_m", "tile_n", "epi_tile_m", "epi_tile_n"):
      value = getattr(self, name)
      if value <= 0 or value % 64:
        raise ValueError(f"{name}={value} must be a positive multiple of 64")
    if self.tile_k not in (32, 64, 128):
      raise ValueError(f"tile_k={self.tile_k} must be 32, 64 or 128")
    if self.max_concurrent_steps < 2:
      raise ValueError(
          f"max_concurrent_steps={self.max_concurrent_steps} must be >= 2")
    for name in ("wg_dimension", "grid_minor_dim"):
      if getattr(self, name) not in ("m", "n"):
        raise ValueError(f"{name}={getattr(self, name)!r} must be 'm' or 'n'")
    if self.send_gap < 1:
      raise ValueError(f"send_gap={self.send_gap} must be >= 1")
    if (self.send_pieces < 1 or self.epi_tile_m % self.send_pieces
        or (self.epi_tile_m // self.send_pieces) % 8):
      raise ValueError(
          f"send_pieces={self.send_pieces} must split epi_tile_m="
          f"{self.epi_tile_m} into pieces of a multiple of 8 rows")
    if self.grid_tile_width < 1:
      raise ValueError(f"grid_tile_width={self.grid_tile_width} must be >= 1")
    if self.tile_m % self.epi_tile_m or self.tile_n % self.epi_tile_n:
      raise ValueError(
          f"epilogue tile {self.epi_tile_m}x{self.epi_tile_n} must divide the "
          f"tile {self.tile_m}x{self.tile_n}")

  @property
  def cta_tile_m(self) -> int:
    return self.tile_m * (2 if self.wg_dimension == "m" else 1)

  @property
  def cta_tile_n(self) -> int:
    return self.tile_n * (2 if self.wg_dimension == "n" else 1)

  def smem_bytes(self, itemsize: int, out_itemsize: int) -> int:
    """Shared memory the kernel allocates per block."""
    pipeline = self.max_concurrent_steps * self.tile_k * (
        self.cta_tile_m + self.cta_tile_n) * itemsize
    epilogue = 2 * 2 * self.epi_tile_m * self.epi_tile_n * out_itemsize
    return pipeline + epilogue + SMEM_RESERVE

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Padding:
  """How far each local dimension is padded to fit the tiles."""

  m: int
  k: int
  n: int

  @property
  def any(self) -> bool:
    return bool(self.m or self.k or self.n)


def padding(config: AllGatherMatmulConfig, m: int, k: int, n: int) -> Padding:
  up = lambda x, t: -x % t
  return Padding(m=up(m, config.cta_tile_m), k=up(k, config.tile_k),
                 n=up(n, config.cta_tile_n))


def unsupported_reason(*, platform: str, device_kind: str, dtype, m: int,
                       k: int, n: int, axis_size: int,
                       out_dtype=None) -> str | None:
  """Why the Hopper kernel cannot serve this problem, or None if it can.

  Depends only on global facts (platform, device kind, dtype, per-shard
  sizes), so every process answers the same.
  """
  if platform not in ("gpu", "cuda"):
    return f"backend is {platform!r}, the kernel needs a CUDA GPU"
  if not any(kind in device_kind for kind in HOPPER_DEVICE_KINDS):
    return f"device {device_kind!r} is not a Hopper (sm_90a) GPU"
  if np.dtype(dtype).name not in KERNEL_DTYPES:
    return f"dtype {np.dtype(dtype).name} (kernel takes bf16 or f16)"
  if out_dtype is not None and np.dtype(out_dtype).name not in (
      np.dtype(dtype).name, "float32"):
    return f"preferred_element_type {np.dtype(out_dtype).name}"
  if min(m, k, n) <= 0:
    return f"empty problem m={m} k={k} n={n}"
  if axis_size < 1:
    return f"axis size {axis_size}"
  return None


COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer="


def command_buffer_reason(platform: str,
                          xla_flags: str | None = None) -> str | None:
  """Why XLA's command buffers make the kernels unsafe here, or None.

  XLA on GPU records runs of thunks into CUDA graphs and replays them. Under
  replay the Mosaic collective kernels lose their cross-device ordering:
  inside MaxText on 2 x H200 (JAX 0.11.2) every step from the first replay
  on gave wrong gradients, and with command buffers off the same run
  matched the baseline (benchmarks/maxtext/). So the kernels run only when
  XLA_FLAGS switches them off (`--xla_gpu_enable_command_buffer=`, as the
  MaxText launcher sets it). `xla_flags`: XLA_FLAGS (default: the process
  environment, the same on every process of a job).
  """
  if platform not in ("gpu", "cuda"):
    return None
  flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  values = re.findall(re.escape(COMMAND_BUFFER_FLAG) + r"(\S*)", flags)
  if values and values[-1].strip("'\"") == "":
    return None
  return ("XLA command buffers (CUDA graphs) are on, and the kernels give "
          "wrong results under graph replay: set XLA_FLAGS="
          f"{COMMAND_BUFFER_FLAG} to use them")


def process_layout_reason(axis_size: int, process_count: int,
                          local_device_count: int) -> str | None:
  """Why the ring's devices cannot run the kernels as the program's
  processes own them, or None.

  With a ring over devices of several processes the kernel reaches its
  peers through NCCL's `ncclGetPeerDevicePointer`, which fails with
  NCCL 2.28.9 (`unhandled system error` at the first step, BUILD.md, issue
  3); one process owning every device of the ring works. A process that
  owns fewer devices than the ring has cannot own the whole ring.
  """
  if process_count > 1 and local_device_count < axis_size:
    return (f"the ring over {axis_size} devices spans several processes "
            f"({process_count} processes of {local_device_count} devices): "
            "that path fails on NCCL 2.28.9 (BUILD.md); give each process "
            "every GPU of its ring")
  return None


def prepare_xla_for_kernels() -> bool:
  """Switches XLA's command buffers off (XLA_FLAGS), so the Hopper kernels
  may run (see `command_buffer_reason`). Call before JAX starts its GPU
  backend; an explicit `--xla_gpu_enable_command_buffer=...` in XLA_FLAGS
  is left as it is.

  Returns:
    Whether XLA_FLAGS now switches command buffers off.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if COMMAND_BUFFER_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFER_FLAG}".strip()
  return command_buffer_reason("gpu") is None


def too_small_reason(m: int, k: int, n: int, dtype, axis_size: int,
                     num_sms: int = 132) -> str | None:
  """Why overlapping does not pay for this problem, or None if it does.

  When one ring step has too few output tiles to keep half the SMs busy,
  each step's tiles wait on the previous step's data with the GPU mostly
  idle; an NCCL all-gather followed by one cuBLAS GEMM is faster (measured
  on 2 x H200 at 512/4096/4096: benchmarks/RESULTS.md).
  """
  config = select_config(m, k, n, dtype, axis_size, num_sms)
  pad = padding(config, m, k, n)
  per_step = ((m + pad.m) // config.cta_tile_m) * (
      (n + pad.n) // config.cta_tile_n)
  if axis_size > 1 and per_step < num_sms / 2:
    return (f"only {per_step} output tiles per ring step for {num_sms} SMs "
            f"(local {m}x{k}x{n}): all-gather + GEMM is faster")
  return None


def _candidates():
  for tile_m, tile_n, wg in ((128, 128, "n"), (128, 128, "m"),
                             (128, 64, "n"), (64, 128, "n"), (64, 64, "n")):
    yield AllGatherMatmulConfig(tile_m=tile_m, tile_n=tile_n, wg_dimension=wg,
                                epi_tile_m=64, epi_tile_n=64)


def fit_shared_memory(config: AllGatherMatmulConfig, dtype,
                      out_dtype=None) -> AllGatherMatmulConfig | None:
  """`config` with as many pipeline stages (<= its own) as fit, or None."""
  itemsize = np.dtype(dtype).itemsize
  out_itemsize = np.dtype(out_dtype or dtype).itemsize
  for stages in range(config.max_concurrent_steps, 1, -1):
    fitted = dataclasses.replace(config, max_concurrent_steps=stages)
    if fitted.smem_bytes(itemsize, out_itemsize) <= SMEM_BYTES:
      return fitted
  return None


def select_config(m: int, k: int, n: int, dtype, axis_size: int,
                  num_sms: int = 132, out_dtype=None) -> AllGatherMatmulConfig:
  """A tile configuration for local shards `m x k` and `k x n`.

  Looks first in the autotune cache (`COLLECTIVE_MATMUL_TUNING_CACHE`), else
  picks by a heuristic: the largest CTA tile that needs the least padding and
  still gives at least half the SMs work across the ring. Pipeline depth is
  reduced where a float32 output's epilogue buffers would not fit.
  """
  cached = _cached_fitting(m, k, n, dtype, axis_size, out_dtype, "all_gather")
  return cached or _heuristic_config(m, k, n, dtype, axis_size, num_sms,
                                     out_dtype)


def _cached_fitting(m, k, n, dtype, axis_size, out_dtype, pattern):
  cached = load_cached_config(m, k, n, dtype, axis_size, pattern=pattern)
  return None if cached is None else fit_shared_memory(cached, dtype,
                                                       out_dtype)


def _heuristic_config(m, k, n, dtype, axis_size, num_sms, out_dtype):
  def score(cfg: AllGatherMatmulConfig):
    pad = padding(cfg, m, k, n)
    waste = ((m + pad.m) * (n + pad.n)) / (m * n) - 1
    tiles = axis_size * ((m + pad.m) // cfg.cta_tile_m) * (
        (n + pad.n) // cfg.cta_tile_n)
    underfill = max(0.0, 1 - tiles / (num_sms / 2))
    area = cfg.cta_tile_m * cfg.cta_tile_n
    return (round(waste + underfill, 3), -area, cfg.wg_dimension != "n")

  fitting = [c for c in map(lambda c: fit_shared_memory(c, dtype, out_dtype),
                            _candidates()) if c is not None]
  return min(fitting, key=score)


def _tiles_per_step(cfg: AllGatherMatmulConfig, m: int, n: int) -> int:
  pad = padding(cfg, m, 0, n)
  return ((m + pad.m) // cfg.cta_tile_m) * ((n + pad.n) // cfg.cta_tile_n)


def select_reduce_scatter_config(m: int, k: int, n: int, dtype, axis_size: int,
                                 num_sms: int = 132,
                                 out_dtype=None) -> AllGatherMatmulConfig:
  """`select_config` with the epilogue the reduce-scatter kernel wants.

  Its epilogue stores each tile's partial sum to the next device. With the
  whole warpgroup tile in two epilogue slots (epi tile = half the tile) an
  epilogue never waits for NVLink to drain a slot, and the stores overlap
  the next tile's main loop; the shared memory comes from one pipeline stage
  (the kernel does not forward from its pipeline, so it releases slots
  without delay and 3 stages prefetch as deep as the all-gather's 4).
  Kept as selected when a wider epilogue would leave fewer than 3 stages.
  Measured on 2 x H200: benchmarks/RESULTS.md. An autotune cache entry for
  this pattern (never the all-gather kernel's) takes precedence.
  """
  cached = _cached_fitting(m, k, n, dtype, axis_size, out_dtype,
                           "reduce_scatter")
  if cached is not None:
    return cached
  base = _heuristic_config(m, k, n, dtype, axis_size, num_sms, out_dtype)
  if base.tile_m % 2 or (base.tile_m // 2) % 64:
    return base
  # Send pacing (benchmarks/RESULTS.md, history/13-15): with D = 2 and a
  # ring step's tiles in one wave, every SM stores its partial sum at the
  # same moment; 4 row pieces 6 steps apart keep each remote store short
  # (1024/4096/4096: 100.0 us vs 110.6 whole slots). Over several waves
  # the SMs drift apart and 2 pieces 12 apart are best (1.2 % and 0.7 %
  # faster than whole slots; 4 pieces 12-14 % slower, with or without the
  # link); so are they at D = 4 at 1024/4096/4096 (195.6 us vs 212.5 for 4
  # pieces, h200x4/autotune_rs_d4.log).
  one_wave = _tiles_per_step(base, m, n) <= num_sms
  pieces, gap = (4, 6) if axis_size == 2 and one_wave else (2, 12)
  wide = fit_shared_memory(
      dataclasses.replace(base, epi_tile_m=base.tile_m // 2,
                          epi_tile_n=base.tile_n, send_gap=gap,
                          send_pieces=pieces),
      dtype, out_dtype)
  if wide is None or wide.max_concurrent_steps < 3:
    return base
  return wide


def cache_path() -> str:
  return os.environ.get(
      "COLLECTIVE_MATMUL_TUNING_CACHE",
      os.path.join(os.path.expanduser("~"), ".cache", "collective_matmul",
                   "tuning.json"))


CACHE_PATTERNS = ("all_gather", "reduce_scatter")


def cache_key(m, k, n, dtype, axis_size, device_kind=None,
              pattern="all_gather") -> str:
  """Key of a cache entry; the two kernels' entries never mix."""
  if pattern not in CACHE_PATTERNS:
    raise ValueError(f"pattern {pattern!r} is not one of {CACHE_PATTERNS}")
  kind = device_kind or _local_device_kind()
  key = f"{kind}|{np.dtype(dtype).name}|D={axis_size}|{m}x{k}x{n}"
  return key if pattern == "all_gather" else f"{pattern}|{key}"


def _local_device_kind() -> str:
  import jax
  return jax.devices()[0].device_kind


_warned_multiprocess_cache = []


def _process_count() -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_count()


def load_cached_config(m, k, n, dtype, axis_size, device_kind=None, *,
                       pattern="all_gather"):
  """The autotuned config of this problem, or None.

  None too when the program runs on several processes: each reads its own
  host's file, and processes that chose differently would hang the ring,
  so a per-host cache never changes a choice there. An entry this version
  cannot read (older or newer fields) is a miss, not an error.
  """
  path = cache_path()
  if not os.path.exists(path):
    return None
  if _process_count() > 1:
    if not _warned_multiprocess_cache:
      _warned_multiprocess_cache.append(path)
      from absl import logging  # pylint: disable=g-import-not-at-top
      logging.warning(
          "collective matmul: the autotune cache %s is not used in a "
          "multi-process program (each process would read its own host's "
          "file); the built-in tile choice applies", path)
    return None
  try:
    with open(path) as f:
      entry = json.load(f).get(cache_key(m, k, n, dtype, axis_size,
                                         device_kind, pattern))
    return AllGatherMatmulConfig(**entry) if entry else None
  except (OSError, ValueError, TypeError):
    return None


def store_cached_config(config: AllGatherMatmulConfig, m, k, n, dtype,
                        axis_size, device_kind=None, *,
                        pattern="all_gather") -> str:
  path = cache_path()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  table = {}
  if os.path.exists(path):
    with open(path) as f:
      table = json.load(f)
  table[cache_key(m, k, n, dtype, axis_size, device_kind,
                  pattern)] = config.to_json()
  with open(path + ".tmp", "w") as f:
    json.dump(table, f, indent=1, sort_keys=True)
  os.replace(path + ".tmp", path)
  return path


# The ring schedule: the kernel traces these same functions on its scalars
# (so they use only ops Mosaic GPU lowers); tests run them on CPU arrays.

def tile_coordinates(linear, m_iters, n_iters):
  """Linear tile index -> (ring step, tile index within the step).

  Steps are outermost so every device works through step s before s + 1:
  all waits point to strictly earlier tiles, so the ring cannot deadlock.
  """
  from jax import lax
  per_step = m_iters * n_iters
  return lax.div(linear, per_step), lax.rem(linear, per_step)


def send_plan(k_iters: int, n_iters: int, spread: bool, gap: int = 1):
  """(k blocks per sender, number of senders, steps between sends).

  With `spread`, n-tile j forwards k blocks [j * per, (j + 1) * per), so the
  block is on its way after `per` pipeline steps instead of `k_iters`.
  Without, n-tile 0 forwards all of them (the seed's scheme).
  """
  if not spread:
    return k_iters, 1, 1
  per = math.ceil(k_iters / n_iters)
  # Every send must fall inside the pipeline: (per - 1) * gap < k_iters.
  gap = max(1, min(gap, (k_iters - 1) // max(per - 1, 1)))
  return per, math.ceil(k_iters / per), gap


def partial_send_steps(k_iters: int, slots: int, gap: int) -> list[int]:
  """Pipeline steps at which the reduce-scatter kernel sends each of the
  previous tile's `slots` stores (epilogue slots x `send_pieces`): 0, gap,
  2 * gap, ..., squeezed so the last falls inside the k loop (all at step 0
  when the loop has one step)."""
  gap = min(gap, (k_iters - 1) // max(slots - 1, 1))
  return [i * gap for i in range(slots)]


def partial_announce_step(k_iters: int, slots: int, gap: int,
                          deferred: bool) -> int | None:
  """Pipeline step at which the reduce-scatter kernel announces the previous
  tile's partial sum: `gap` steps after its last send (the sends left in
  the previous epilogue when not `deferred`), or None (after the k loop)
  when that falls outside the loop."""
  last_send = partial_send_steps(k_iters, slots, gap)[-1] if deferred else 0
  step = last_send + gap
  return step if step < k_iters else None


def sender_share(n_idx, k_iters: int, per: int):
  """How many k blocks n-tile `n_idx` forwards (0 for non-senders)."""
  import jax.numpy as jnp
  return jnp.minimum(jnp.maximum(k_iters - n_idx * per, 0), per)


def k_block(kk, n_idx, k_iters: int, per: int, gap: int):
  """The k block a tile's pipeline loads at step `kk`: a permutation of k.

  N-tile `n_idx` forwards the `share` blocks starting at `n_idx * per`; they
  are placed at pipeline steps 0, gap, 2 * gap, ... (so the sends are paced
  and the tile's own slice of the row block leaves early); the other blocks
  fill the remaining steps in increasing order.
  """
  import jax.numpy as jnp
  from jax import lax
  share = sender_share(n_idx, k_iters, per)
  start = n_idx * per
  in_share = (lax.rem(kk, gap) == 0) & (lax.div(kk, gap) < share)
  shares_so_far = jnp.minimum(lax.div(kk, gap) + 1, share)
  other = kk - shares_so_far
  other = jnp.where(other < start, other, other + share)
  return jnp.where(in_share, start + lax.div(kk, gap), other)


def last_send_step(n_idx, k_iters: int, per: int, gap: int):
  """Pipeline step of a tile's last send (negative when it sends nothing)."""
  return (sender_share(n_idx, k_iters, per) - 1) * gap


def output_row(local_row, source, axis_size: int, rows_per_batch: int):
  """Output row of `local_row` of device `source`'s shard.

  The shard is `[b, s]` rows flattened (s = rows_per_batch); the output is
  `[b, D * s]` flattened, so a row tile within one b stays contiguous.
  """
  from jax import lax
  batch = lax.div(local_row, rows_per_batch)
  within = lax.rem(local_row, rows_per_batch)
  return (batch * axis_size + source) * rows_per_batch + within


def supports_rows_per_batch(config: AllGatherMatmulConfig, m: int,
                            rows_per_batch: int) -> bool:
  """Whether the kernel can write `[b, D * s, n]` directly for this shard."""
  return m % rows_per_batch == 0 and rows_per_batch % config.cta_tile_m == 0


def reduce_scatter_block(device, step, axis_size: int):
  """Row block whose partial sum device `device` works on at ring step `step`.

  (device - step - 1) mod D: the sum for block j starts at device j + 1 and
  moves one device on per step, ending complete on device j at step D - 1.
  """
  from jax import lax
  return lax.rem(device - step - 1 + 2 * axis_size, axis_size)


def source_device(device, step, axis_size):
  """Whose shard device `device` multiplies at ring step `step`."""
  from jax import lax
  return lax.rem(device + step, axis_size)
