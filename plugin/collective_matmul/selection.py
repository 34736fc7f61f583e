"""Which implementation serves a collective matmul, and with which config.

The layer between the kernels and the ops: whether the Hopper kernels apply
(device, dtype, XLA settings, process layout), whether they pay off (the
small-problem rule), the tile heuristics, the on-disk autotune cache and the
packaged table of measured configs, the device facts these read, and the one
implementation decision for a forward pass and its backward (`choose_impl`,
`backward_impl`), which the drop-in `dot_general` and the ops both use.

Pure Python: it reads `kernels.configs` and `kernels.schedule` (no Pallas),
so `import collective_matmul` does not import Mosaic GPU. The decision
depends only on global facts (platform, device kind, dtype, per-shard sizes,
flags), so every process answers the same; the per-host cache is not read
in a multi-process program for that reason, while the packaged table
(`tuned_configs.json`, shipped with the package) is.

A kernel config comes from, first to last: the caller's explicit config; the
per-host autotune cache (single-process programs only); the packaged table;
the heuristics (`config_source` says which applies).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import os
import re
import types
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from collective_matmul.enums import Collective
from collective_matmul.enums import Impl
from collective_matmul.kernels.configs import AllGatherConfig
from collective_matmul.kernels.configs import KERNEL_DTYPES
from collective_matmul.kernels.configs import ReduceScatterConfig
from collective_matmul.kernels.configs import SMEM_BYTES
from collective_matmul.kernels.configs import TileConfig
from collective_matmul.kernels.schedule import padding
from collective_matmul.kernels.schedule import supports_rows_per_batch

__all__ = [
    "AllGatherConfig", "ReduceScatterConfig", "KERNEL_DTYPES", "SMEM_BYTES",
    "HOPPER_DEVICE_KINDS", "COMMAND_BUFFER_FLAG", "CACHE_PATTERNS",
    "DeviceFacts", "device_facts", "unsupported_reason",
    "command_buffer_reason", "process_layout_reason",
    "prepare_xla_for_kernels", "too_small_reason", "tile_candidates",
    "default_config", "fit_shared_memory", "select_config",
    "select_reduce_scatter_config",
    "cache_path", "cache_key", "load_cached_config", "store_cached_config",
    "TUNED_CONFIGS_FILE", "parse_tuned_configs", "packaged_table",
    "packaged_config", "config_source",
    "Verdict", "kernel_verdict", "Choice", "choose_impl", "backward_impl",
    "padding", "supports_rows_per_batch",
]

HOPPER_DEVICE_KINDS = ("H100", "H200", "H800", "H20", "GH200")

# ---------------------------------------------------------------- device facts


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
  """What the decision reads about the machine.

  platform, device_kind, num_cores: of the mesh's devices (an abstract
  mesh's `abstract_device` when it describes them, else the first device).
  process_count, local_device_count: of the running program.
  """

  platform: str
  device_kind: str
  num_cores: int
  process_count: int = 1
  local_device_count: int = 1


def device_facts(mesh=None) -> DeviceFacts:
  """The facts of `mesh`'s devices (None: the default backend's)."""
  device = getattr(mesh, "abstract_device", None)
  platform = getattr(device, "platform", None) or jax.default_backend()
  kind = (getattr(device, "device_kind", None)
          or jax.devices()[0].device_kind)
  cores = (getattr(device, "num_cores", None)
           or getattr(jax.devices()[0], "core_count", 132))
  return DeviceFacts(platform=platform, device_kind=kind, num_cores=cores,
                     process_count=jax.process_count(),
                     local_device_count=jax.local_device_count())


def _local_device_kind() -> str:
  return jax.devices()[0].device_kind


# --------------------------------------------------------------- applicability


def unsupported_reason(*, platform: str, device_kind: str, dtype, m: int,
                       k: int, n: int, axis_size: int,
                       out_dtype=None) -> str | None:
  """Why the Hopper kernels cannot serve this problem, or None if they can.

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
  inside MaxText on 2 x H200 every step from the first replay on gave wrong
  gradients, and with command buffers off the same run matched the baseline
  (benchmarks/maxtext/). So the kernels run only when XLA_FLAGS switches
  them off (`--xla_gpu_enable_command_buffer=`, as the MaxText launcher sets
  it). `xla_flags`: XLA_FLAGS (default: the process environment, the same
  on every process of a job).
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


class SmallBox(NamedTuple):
  """Per-shard problems (rows, local contraction k, local columns n) where
  the kernels were measured faster than NCCL + cuBLAS although a ring step
  has few tiles."""

  min_rows: int
  k_range: tuple[int, int]
  min_n: int

  def holds(self, m: int, k: int, n: int) -> bool:
    low, high = self.k_range
    return m >= self.min_rows and low <= k <= high and n >= self.min_n

  def __str__(self):
    low, high = self.k_range
    return (f"from {self.min_rows} rows with k {low}-{high} and "
            f"n >= {self.min_n}")


# Where small problems were measured worth overlapping at D = 2 (the
# all-gather's dedicated senders, the reduce-scatter's concurrent ring
# steps): 2 x H200, 37 shapes, benchmarks/kernel_lead/, runs 27-29
# (`plot_small_problems.py`). Both kernels were faster than NCCL + cuBLAS
# at every shape inside, by up to 1.8 x (the slowest: a tie at
# reduce-scatter 384/5504/4096 and 128/8192/4096). They lost at
# all-gather 64/4096/4096 (-4 %) and 128/14336/4096 (-5 %) and at
# reduce-scatter 128/4096/1024 (-26 %), all outside.
SMALL_BOXES = (SmallBox(128, (2048, 8192), 2048),
               SmallBox(256, (1024, 14336), 1024))


def too_small_reason(m: int, k: int, n: int, dtype, axis_size: int,
                     num_sms: int = 132) -> str | None:
  """Why overlapping does not pay for this problem, or None if it does.

  `m` is the per-shard rows (before the all-gather, after the
  reduce-scatter), `k` the local contraction. When one ring step has too
  few output tiles to keep half the SMs busy, each step's tiles wait on
  the previous step's data with the GPU mostly idle, and an NCCL collective
  with one cuBLAS GEMM is faster; except at D = 2 inside `SMALL_BOXES`,
  where the all-gather's dedicated senders and the reduce-scatter's
  concurrent ring steps were measured faster (2 x H200:
  benchmarks/kernel_lead/, runs 27-29).
  """
  config = select_config(m, k, n, dtype, axis_size, num_sms)
  per_step = _tiles_per_step(config, m, n)
  if axis_size == 1 or per_step >= num_sms / 2:
    return None
  if axis_size == 2 and any(box.holds(m, k, n) for box in SMALL_BOXES):
    return None
  where = ("; at D = 2 measured faster "
           + " or ".join(map(str, SMALL_BOXES)) if axis_size == 2 else "")
  return (f"only {per_step} output tiles per ring step for {num_sms} SMs "
          f"(local {m}x{k}x{n}{where}): the collective + GEMM is faster")


# ------------------------------------------------------------------ heuristics


def tile_candidates():
  """The all-gather kernel's tile shapes the heuristic (and autotuning)
  choose from."""
  for tile_m, tile_n, wg in ((128, 128, "n"), (128, 128, "m"),
                             (128, 64, "n"), (64, 128, "n"), (64, 64, "n")):
    yield AllGatherConfig(tile_m=tile_m, tile_n=tile_n, wg_dimension=wg,
                          epi_tile_m=64, epi_tile_n=64)


def fit_shared_memory(config: TileConfig, dtype, out_dtype=None):
  """`config` with as many pipeline stages (<= its own) as fit, or None."""
  itemsize = np.dtype(dtype).itemsize
  out_itemsize = np.dtype(out_dtype or dtype).itemsize
  for stages in range(config.max_concurrent_steps, 1, -1):
    fitted = dataclasses.replace(config, max_concurrent_steps=stages)
    if fitted.smem_bytes(itemsize, out_itemsize) <= SMEM_BYTES:
      return fitted
  return None


def select_config(m: int, k: int, n: int, dtype, axis_size: int,
                  num_sms: int = 132, out_dtype=None) -> AllGatherConfig:
  """The all-gather kernel's config for local shards `m x k` and `k x n`.

  Looks first in the autotune cache (`COLLECTIVE_MATMUL_TUNING_CACHE`, in a
  single-process program), then in the packaged table (`packaged_config`),
  else picks by a heuristic: the largest CTA tile that needs the least
  padding and still gives at least half the SMs work across the ring.
  Pipeline depth is reduced where a float32 output's epilogue buffers would
  not fit.
  """
  tuned = _tuned(m, k, n, dtype, axis_size, out_dtype, Collective.ALL_GATHER)
  if tuned:
    return tuned.config
  return default_config(m, k, n, dtype, axis_size, num_sms, out_dtype)


def default_config(m: int, k: int, n: int, dtype, axis_size: int,
                   num_sms: int = 132, out_dtype=None) -> AllGatherConfig:
  """`select_config`'s heuristic choice, whatever the caches hold."""
  base = _heuristic_config(m, k, n, dtype, axis_size, num_sms, out_dtype)
  config = _sender_config(base, m, k, n, dtype, axis_size, num_sms,
                          out_dtype) or base
  return _chained(config, k, n, axis_size)


# Where the tiles' sends are released in their own k step so that a block's
# tiles can share one pipeline (`eager_release`, `chain_tiles`): local n up
# to this, at D = 2 (benchmarks/kernel_lead/, runs 16-18).
CHAIN_EAGER_MAX_N = 4096


def _chained(config: AllGatherConfig, k, n, axis_size) -> AllGatherConfig:
  """`config` with a block's tiles on one pipeline (`chain_tiles`) where
  that was measured to win (D = 2, 2 x H200), so the next tile's first k
  blocks load during this one's last steps and epilogue:

  * with the balanced dedicated senders (by rows, several waves per step):
    1005.3 against 1012.4 us at 8192/4096/5504, 1090.8-1092.9 against
    1103.7-1104.5 at 8192/4096/6144 (every round of each run faster);
  * with the tiles' own sends, released in their k step
    (`eager_release`), up to `CHAIN_EAGER_MAX_N` columns: 388.5-390.3
    against 393.3-394.0 us at 8192/4096/2048 in three runs, 187.6 against
    189.0 at 2048/4096/4096. At n = 11008 the eager release cost more
    than the chaining saved (1990.8 against 1959.0 us).

  Not with k-major senders (one wave per step: each SM runs one tile per
  ring step, and the seed shape was 1 us slower chained).

  With the senders, also where the pipeline's steps are no multiple of its
  depth (`kernels.common._OffsetChain`): 949.0 against 956.1 us at
  8192/5504/4096 (86 k steps, 4 stages; every one of 3 rounds faster,
  kernel_lead run 42). The eager branch only where they are (measured so).
  """
  if axis_size != 2:
    return config
  if config.sender_sms and not config.k_major_sends:
    return dataclasses.replace(config, chain_tiles=True)
  k_iters = (k + padding(config, 0, k, 0).k) // config.tile_k
  if (not config.sender_sms and n <= CHAIN_EAGER_MAX_N
      and k_iters % config.max_concurrent_steps == 0):
    return dataclasses.replace(config, eager_release=True, chain_tiles=True)
  return config


# Sender blocks of the dedicated-sender schedule (`AllGatherConfig.sender_sms`).
SENDER_SMS = 4
# Where all ring steps' tiles run at once and leave more SMs idle than
# `SENDER_SMS`, the senders take the idle SMs, up to this many (each moves
# about 25-40 GB/s). 2 x H200, 4 / 8 / 16 / 32 senders: 128/4096/2048
# 25.0 / 22.5 / 21.2 / 23.5 us, 384/4096/2048 38.1 / 31.4 / 30.6 / 37.3,
# 64/4096/4096 30.2 / 29.7 / 26.8 / 26.7, 128/4096/5504 35.3 / 32.8 /
# 33.9 / 32.7 (benchmarks/kernel_lead/, run 28).
SENDER_MAX_IDLE_SMS = 16


# Where the dedicated senders beat the paced sends at several waves per ring
# step (D = 2, 2 x H200, benchmarks/kernel_lead/README.md, run 7): local n
# from 4096 to 8192 columns with m >= 4096 rows per shard.
SENDER_BALANCED_N = (4096, 8192)
SENDER_BALANCED_MIN_M = 4096
# K-major senders where a ring step is one wave (D = 2): only from this local
# n on, where a step's GEMM (2 m k n flops) lasts long enough for the
# senders' ~90 GB/s to deliver the shard (m k elements) within two steps
# (measured at n = 4096: benchmarks/kernel_lead/, runs 13-16).
SENDER_K_MAJOR_MIN_N = 4096
# Where all ring steps are one wave (the senders' transfer was the kernel's
# critical path): the k step of the tiles and so of the senders' chunks
# (256-byte rows). 512/4096/4096 bf16 on 2 x H200: 53.3-53.5 against
# 58.8-59.7 us with 64 (benchmarks/kernel_lead/, runs 24-26). Not separated
# yet: how much is the senders' wider rows and how much the tiles' deeper
# k pipeline (3 x 128 columns against 4 x 64). Taken only with >=
# SENDER_WIDE_MIN_STAGES pipeline stages (2 stages: 63.8 us).
SENDER_WIDE_TILE_K = 128
SENDER_WIDE_MIN_STAGES = 3


def _sender_config(base: AllGatherConfig, m, k, n, dtype, axis_size, num_sms,
                   out_dtype) -> AllGatherConfig | None:
  """The dedicated-sender schedule where it was measured to win, else None.

  All ring steps in one wave: when every ring step's tiles of `base` fit in
  one wave, the remote tiles sit idle until sends paced through the local
  tiles' k loops deliver their rows. There, `SENDER_SMS` blocks that only
  send (about 25-40 GB/s each) and the largest CTA tile (>= 128 rows)
  whose ring step fills the other SMs once let each SM run its local tile
  while its remote rows arrive: 512/4096/4096 bf16 on 2 x H200 went from
  79-83 to 60-63 us (the upstream example 95, NCCL + cuBLAS 79;
  benchmarks/kernel_lead/). K-major (`k_major_sends`): a remote tile
  starts as soon as the first k group is in, 0.3-2.5 us sooner. There the
  senders' transfer was the critical path, and 128-column k steps
  (`SENDER_WIDE_TILE_K`: the senders copy 256-byte rows) took it to
  53.3-53.5 us (1.13-1.14 x bound) where 3 pipeline stages fit; in
  loopback it takes the same (53.3), where the 64-column k step lost 4.6
  us to the link (run 28).
  Where `base`'s tiles already fill the most SMs a ring step can (fewer
  rows), the senders join them, and where all steps' tiles leave more SMs
  idle, up to `SENDER_MAX_IDLE_SMS` send: at 64-512 rows up to 1.9 x
  faster than without senders (never slower), and 1.1-1.8 x faster than
  NCCL + cuBLAS where `impl=auto` takes them (runs 27-29,
  `too_small_reason`).

  One wave per step (the seed shape, 128 tiles on 132 SMs): the same
  senders, k-major, with `base`'s tiles on the other SMs: the next step's
  tiles start at once and the senders need only stay ahead of their k
  loops. 1024/4096/4096: 98.5-99.6 against 102.9-103.9 us in four runs
  (bf16; f16 101.7 against 106.2); announcing each group as soon as it
  landed (`SenderPlan.announce_lag`), 97.2 against the example's 102.3
  (run 26). By rows they lost (120 us): the last
  row block arrived long after its tiles could have started. Only from
  `SENDER_K_MAJOR_MIN_N` on: the transfer's time against a step's is a
  ratio of n alone, and at 2048/4096/4096 (two waves per step) k-major
  senders lost too (196-199 against 188-189 us).

  Balanced, several waves per step: a ring step's GEMM (2 m k n flops)
  against the senders' transfer of the shard (m k elements) is a ratio of
  n alone. Where the two take about as long, the senders deliver each row
  block in time and the other SMs compute without sends in their k loops:
  with `base`'s tiles, 1-3 % faster at n = 4096-8192, m = 4096 and 8192
  (`SENDER_BALANCED_N`, `SENDER_BALANCED_MIN_M`). Below, the transfer
  outlasts the step (n = 2048: +50 %, n = 3072: +10 %); above, the senders'
  SMs are missed (n = 11008, 14336: +1 %); at the seed shape (m = 1024, two
  waves) they lost 120 against 104 us. Measured at D = 2, with the
  128 x 256 CTA tile (`wg_dimension="n"`, run 7) and with the 256 x 128 one
  the heuristic takes where n is no multiple of 256 (n = 5504, the llama2
  MLP output's backward: 1.8-2.0 % faster in three runs, the last 7 rounds
  round-robin; benchmarks/kernel_lead/ runs 9 and 11).
  """
  if _steps_in_one_wave(base, m, n, axis_size, num_sms):
    tiles = _one_round_tiles(base, m, n, dtype, out_dtype,
                             num_sms - SENDER_SMS)
    if tiles is None:  # `base` already fills the most SMs it can.
      tiles = base
    idle = num_sms - axis_size * _tiles_per_step(tiles, m, n)
    if tiles is base and idle < SENDER_SMS:
      # The senders would push tiles into a second wave: no senders.
      return None
    senders = dataclasses.replace(
        tiles, sender_sms=max(SENDER_SMS, min(idle, SENDER_MAX_IDLE_SMS)),
        k_major_sends=True)
    wide = wide_sender_tiles(senders, dtype, out_dtype)
    if wide is not None and k % SENDER_WIDE_TILE_K == 0:
      return wide
    return fit_shared_memory(senders, dtype, out_dtype)
  if (axis_size == 2 and n >= SENDER_K_MAJOR_MIN_N
      and _tiles_per_step(base, m, n) <= num_sms - SENDER_SMS):
    return fit_shared_memory(
        dataclasses.replace(base, sender_sms=SENDER_SMS, k_major_sends=True),
        dtype, out_dtype)
  low, high = SENDER_BALANCED_N
  if axis_size == 2 and low <= n <= high and m >= SENDER_BALANCED_MIN_M:
    return fit_shared_memory(dataclasses.replace(base, sender_sms=SENDER_SMS),
                             dtype, out_dtype)
  return None


def wide_sender_tiles(config: AllGatherConfig, dtype,
                      out_dtype=None) -> AllGatherConfig | None:
  """`config` with the k step `SENDER_WIDE_TILE_K`, if at least
  `SENDER_WIDE_MIN_STAGES` pipeline stages of it fit, else None."""
  wide = fit_shared_memory(
      dataclasses.replace(config, tile_k=SENDER_WIDE_TILE_K), dtype,
      out_dtype)
  if wide is None or wide.max_concurrent_steps < SENDER_WIDE_MIN_STAGES:
    return None
  return wide


def _steps_in_one_wave(config: TileConfig, m, n, axis_size, num_sms) -> bool:
  """At D = 2 (where it was measured), whether all ring steps' tiles of
  `config` run in one wave: a remote tile then waits idle for data that its
  peer produces (the all-gather's rows, the reduce-scatter's partial sum)
  in a tile running at the same time."""
  return axis_size == 2 and axis_size * _tiles_per_step(config, m, n) <= (
      num_sms)


def _one_round_tiles(base: TileConfig, m, n, dtype, out_dtype,
                     blocks) -> AllGatherConfig | None:
  """The tiles (>= 128 rows) whose ring step fills the most of `blocks` SMs
  (ties in `tile_candidates` order), if that is more tiles per step than
  `base` has, else None: each SM then runs one tile of each step in turn,
  and a step's data moves while the previous step computes."""
  fitting = [c for c in (fit_shared_memory(t, dtype, out_dtype)
                         for t in tile_candidates())
             if c is not None and c.cta_tile_m >= 128
             and _tiles_per_step(c, m, n) <= blocks]
  if not fitting:
    return None
  best = max(fitting, key=lambda c: _tiles_per_step(c, m, n))
  more = _tiles_per_step(best, m, n) > _tiles_per_step(base, m, n)
  return best if more else None


AUTOTUNE_CACHE = "autotune cache"
PACKAGED_TABLE = "packaged table"
HEURISTIC = "heuristic"


class _Tuned(NamedTuple):
  source: str  # AUTOTUNE_CACHE or PACKAGED_TABLE.
  config: TileConfig


def _tuned(m, k, n, dtype, axis_size, out_dtype, pattern) -> _Tuned | None:
  """The first measured config of this problem that fits shared memory (with
  `out_dtype`): the per-host autotune cache's, then the packaged table's."""
  for source, lookup in ((AUTOTUNE_CACHE, load_cached_config),
                         (PACKAGED_TABLE, packaged_config)):
    found = lookup(m, k, n, dtype, axis_size, pattern=pattern)
    fitted = None if found is None else fit_shared_memory(found, dtype,
                                                          out_dtype)
    if fitted is not None:
      return _Tuned(source, fitted)
  return None


def config_source(m: int, k: int, n: int, dtype, axis_size: int,
                  out_dtype=None, *, pattern=Collective.ALL_GATHER) -> str:
  """Where `select_config` (pattern all_gather) or
  `select_reduce_scatter_config` (reduce_scatter) takes this problem's
  config from: "autotune cache", "packaged table" or "heuristic"."""
  tuned = _tuned(m, k, n, dtype, axis_size, out_dtype,
                 Collective.parse(pattern, "pattern"))
  return tuned.source if tuned else HEURISTIC


def _heuristic_config(m, k, n, dtype, axis_size, num_sms, out_dtype):
  def score(cfg: AllGatherConfig):
    pad = padding(cfg, m, k, n)
    waste = ((m + pad.m) * (n + pad.n)) / (m * n) - 1
    tiles = axis_size * _tiles_per_step(cfg, m, n)
    underfill = max(0.0, 1 - tiles / (num_sms / 2))
    area = cfg.cta_tile_m * cfg.cta_tile_n
    return (round(waste + underfill, 3), -area, cfg.wg_dimension != "n")

  fitting = [c for c in map(lambda c: fit_shared_memory(c, dtype, out_dtype),
                            tile_candidates()) if c is not None]
  return min(fitting, key=score)


def _tiles_per_step(cfg: TileConfig, m: int, n: int) -> int:
  pad = padding(cfg, m, 0, n)
  return ((m + pad.m) // cfg.cta_tile_m) * ((n + pad.n) // cfg.cta_tile_n)


def select_reduce_scatter_config(m: int, k: int, n: int, dtype, axis_size: int,
                                 num_sms: int = 132,
                                 out_dtype=None) -> ReduceScatterConfig:
  """The reduce-scatter kernel's config: `select_config`'s tiles with the
  epilogue and send pacing that kernel wants.

  Its epilogue stores each tile's partial sum to the next device. With the
  whole warpgroup tile in two epilogue slots (epi tile = half the tile) an
  epilogue never waits for NVLink to drain a slot, and the stores overlap
  the next tile's main loop; the shared memory comes from one pipeline stage
  (the kernel does not forward from its pipeline, so it releases slots
  without delay and 3 stages prefetch as deep as the all-gather's 4).
  Kept as selected when a wider epilogue would leave fewer than 3 stages.
  An autotune cache entry, else a packaged table entry, for this pattern
  (never the all-gather kernel's) takes precedence.

  Send pacing: with D = 2 and a ring step's tiles in one wave, every SM
  stores its partial sum at the same moment, and 4 row pieces 6 steps apart
  keep each remote store short; over several waves, and at D = 4, 2 pieces
  12 apart are best. The measurements: benchmarks/RESULTS.md (the
  reduce-scatter kernel's "What limited it" and the 4 x H200 section).
  """
  tuned = _tuned(m, k, n, dtype, axis_size, out_dtype,
                 Collective.REDUCE_SCATTER)
  if tuned is not None:
    return tuned.config
  tiles = _heuristic_config(m, k, n, dtype, axis_size, num_sms, out_dtype)
  if _steps_in_one_wave(tiles, m, n, axis_size, num_sms):
    # Smaller tiles, so a step's partial sums move while the next computes
    # (512/4096/4096 on 2 x H200: 63.7 -> 55.8 us; benchmarks/kernel_lead/).
    tiles = _one_round_tiles(tiles, m, n, dtype, out_dtype,
                             num_sms) or tiles
  base = ReduceScatterConfig(**tiles.tile_fields())
  if base.tile_m % 2 or (base.tile_m // 2) % 64:
    return base
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


# --------------------------------------------------------------- autotune cache

# A cache entry's pattern: the kernel (collective) it configures.
CACHE_PATTERNS = tuple(c.value for c in Collective)
_CONFIG_CLASSES = {Collective.ALL_GATHER: AllGatherConfig,
                   Collective.REDUCE_SCATTER: ReduceScatterConfig}


def cache_path() -> str:
  return os.environ.get(
      "COLLECTIVE_MATMUL_TUNING_CACHE",
      os.path.join(os.path.expanduser("~"), ".cache", "collective_matmul",
                   "tuning.json"))


def cache_key(m, k, n, dtype, axis_size, device_kind=None,
              pattern=Collective.ALL_GATHER) -> str:
  """Key of a cache entry; the two kernels' entries never mix."""
  pattern = Collective.parse(pattern, "pattern")
  kind = device_kind or _local_device_kind()
  key = f"{kind}|{np.dtype(dtype).name}|D={axis_size}|{m}x{k}x{n}"
  return (key if pattern == Collective.ALL_GATHER
          else f"{pattern.value}|{key}")


def _key_pattern(key: str) -> Collective:
  """The pattern of a `cache_key`."""
  head = key.split("|", 1)[0]
  return (Collective.parse(head, "pattern") if head in CACHE_PATTERNS
          else Collective.ALL_GATHER)


def _config_from_fields(pattern: Collective, fields) -> TileConfig:
  """`pattern`'s config class built from an entry's fields (a JSON object).
  Raises TypeError or ValueError when they do not build one (unknown,
  missing or invalid fields)."""
  if not isinstance(fields, dict):
    raise TypeError(f"config {fields!r} is not a JSON object")
  return _CONFIG_CLASSES[pattern](**fields)


_warned_multiprocess_cache = []


def load_cached_config(m, k, n, dtype, axis_size, device_kind=None, *,
                       pattern=Collective.ALL_GATHER):
  """The autotuned config of this problem for `pattern`'s kernel, or None.

  None too when the program runs on several processes: each reads its own
  host's file, and processes that chose differently would hang the ring,
  so a per-host cache never changes a choice there. An entry this version
  cannot read (older or newer fields) is a miss, not an error.
  """
  path = cache_path()
  if not os.path.exists(path):
    return None
  if jax.process_count() > 1:
    if not _warned_multiprocess_cache:
      _warned_multiprocess_cache.append(path)
      from absl import logging  # pylint: disable=g-import-not-at-top
      logging.warning(
          "collective matmul: the autotune cache %s is not used in a "
          "multi-process program (each process would read its own host's "
          "file); the built-in tile choice applies", path)
    return None
  pattern = Collective.parse(pattern, "pattern")
  key = cache_key(m, k, n, dtype, axis_size, device_kind, pattern)
  try:
    with open(path) as f:
      entry = json.load(f).get(key)
    return _config_from_fields(pattern, entry) if entry else None
  except (OSError, ValueError, TypeError, AttributeError):
    return None


def store_cached_config(config: AllGatherConfig | ReduceScatterConfig, m, k,
                        n, dtype, axis_size, device_kind=None, *,
                        pattern=None) -> str:
  """Stores `config` as the tuned one of its kernel (`pattern`: None, or
  the pattern of the config's class) for this problem; returns the path."""
  own = next(p for p, cls in _CONFIG_CLASSES.items()
             if type(config) is cls)  # pylint: disable=unidiomatic-typecheck
  if pattern is not None and Collective.parse(pattern, "pattern") != own:
    raise ValueError(f"a {type(config).__name__} is the {own.value!r} "
                     f"kernel's config, not the {pattern!r} kernel's")
  path = cache_path()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  table = {}
  if os.path.exists(path):
    with open(path) as f:
      table = json.load(f)
  table[cache_key(m, k, n, dtype, axis_size, device_kind,
                  own)] = config.to_json()
  with open(path + ".tmp", "w") as f:
    json.dump(table, f, indent=1, sort_keys=True)
  os.replace(path + ".tmp", path)
  return path


# --------------------------------------------- packaged table of measured configs

# Package data next to this module; its "_about" says how entries are made.
TUNED_CONFIGS_FILE = "tuned_configs.json"


def parse_tuned_configs(data, origin: str = TUNED_CONFIGS_FILE
                        ) -> Mapping[str, TileConfig]:
  """{cache key: config} of a table in `tuned_configs.json`'s format.

  An entry whose key or config is missing, whose fields do not build its
  kernel's config class (fields of another version), or whose key repeats
  an earlier entry is skipped with a logged warning, never an error.
  """
  from absl import logging  # pylint: disable=g-import-not-at-top
  table = {}
  entries = data.get("entries", []) if isinstance(data, dict) else None
  if not isinstance(entries, list):
    logging.warning("collective matmul: %s has no list of entries; not used",
                    origin)
    return types.MappingProxyType(table)
  for i, entry in enumerate(entries):
    try:
      key = entry["key"]
      if key in table:
        raise ValueError(f"key {key!r} repeats an earlier entry")
      table[key] = _config_from_fields(_key_pattern(key), entry["config"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      logging.warning("collective matmul: entry %d of %s skipped: %s", i,
                      origin, e)
  return types.MappingProxyType(table)


@functools.cache
def packaged_table() -> Mapping[str, TileConfig]:
  """The packaged table of measured configs (`tuned_configs.json`), read
  once; empty, with a logged warning, when it cannot be read."""
  try:
    text = importlib.resources.files(__package__).joinpath(
        TUNED_CONFIGS_FILE).read_text()
    data = json.loads(text)
  except (OSError, ValueError) as e:
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning("collective matmul: the packaged table %s is not "
                    "readable (%s); not used", TUNED_CONFIGS_FILE, e)
    return types.MappingProxyType({})
  return parse_tuned_configs(data)


def packaged_config(m, k, n, dtype, axis_size, device_kind=None, *,
                    pattern=Collective.ALL_GATHER):
  """The packaged table's measured config of this problem for `pattern`'s
  kernel, or None. Read in a multi-process program too: the table ships
  with the package, so every process reads the same one."""
  return packaged_table().get(cache_key(m, k, n, dtype, axis_size,
                                        device_kind, pattern))


# -------------------------------------------------- the implementation decision


class Verdict(NamedTuple):
  """Why the Hopper kernel is not used for one collective matmul.

  impl: the implementation to use instead. hard: the kernel cannot or may
  not run (an explicit `pallas` then falls back); else it would only be
  slower (`auto` avoids it, an explicit `pallas` still runs it).
  """

  reason: str
  impl: Impl
  hard: bool


def kernel_verdict(collective: Collective, rows: int, k: int, n: int, dtype,
                   axis_size: int, device: DeviceFacts, *, out_dtype=None,
                   fallback_impl: Impl = Impl.RING,
                   reduce_scatter_kernel: bool = True) -> Verdict | None:
  """Why the Hopper kernel is not used for `collective` on per-shard rows x
  k x n (rows: before the all-gather, after the reduce-scatter), or None.

  fallback_impl: where the kernel is unavailable off Hopper. On a Hopper GPU
  that may not run it, XLA's own program (NCCL + cuBLAS) is the fast safe
  choice.
  """
  # The same constraints for both kernels (per shard: rows, k, columns).
  reason = unsupported_reason(
      platform=device.platform, device_kind=device.device_kind, dtype=dtype,
      m=rows, k=k, n=n, axis_size=axis_size, out_dtype=out_dtype)
  if reason is not None:
    return Verdict(f"pallas unavailable: {reason}", fallback_impl, True)
  reason = (command_buffer_reason(device.platform) or
            process_layout_reason(axis_size, device.process_count,
                                  device.local_device_count))
  if reason is not None:
    return Verdict(f"pallas unavailable: {reason}", Impl.BASELINE, True)
  if collective == Collective.REDUCE_SCATTER and not reduce_scatter_kernel:
    return Verdict("the reduce-scatter kernel is switched off",
                   Impl.BASELINE, True)
  small = too_small_reason(rows, k, n, dtype, axis_size, device.num_cores)
  if small is not None:
    return Verdict(small, Impl.BASELINE, False)
  return None


class Choice(NamedTuple):
  """The implementations of a matched collective matmul and its backward.

  reason: why not the Hopper kernel ("" when it is used, or not asked for);
  is_fallback: an explicit `pallas` could not be served (strict raises).
  """

  impl: Impl
  backward_impl: Impl
  reason: str
  is_fallback: bool


def choose_impl(requested: Impl | str, collective: Collective | str,
                rows: int, k: int, n: int, dtype, axis_size: int,
                device: DeviceFacts, *, preferred_element_type=None,
                fallback_impl: Impl | str = Impl.RING,
                reduce_scatter_kernel: bool = True) -> Choice:
  """The one implementation decision, forward and backward.

  `auto` takes the Hopper kernel where it applies and pays off, else XLA's
  collective + GEMM for small problems on Hopper, else `fallback_impl`; an
  explicit `pallas` that cannot be served is a fallback. The backward's
  collective matmul (the other collective, with k and n swapped, on the
  forward's output dtype) is chosen the same way.

  Args:
    requested: the configured implementation (auto, pallas, ring, baseline).
    collective: the forward's (all_gather or reduce_scatter).
    rows, k, n: per-shard sizes of the 2-D problem the kernel would see.
    dtype: the operands' dtype.
    axis_size: devices on the ring.
    device: the mesh's device facts (`device_facts`).
    preferred_element_type: the forward's result dtype, or None.
  """
  requested = Impl.parse(requested, "impl")
  collective = Collective.parse(collective, "collective")
  if requested in (Impl.RING, Impl.BASELINE):
    return Choice(requested, requested, "", False)
  options = dict(fallback_impl=Impl.parse(fallback_impl, "fallback_impl"),
                 reduce_scatter_kernel=reduce_scatter_kernel)
  verdict = kernel_verdict(collective, rows, k, n, dtype, axis_size, device,
                           out_dtype=preferred_element_type, **options)
  if verdict is not None and (requested == Impl.AUTO or verdict.hard):
    return Choice(verdict.impl, verdict.impl, verdict.reason,
                  requested == Impl.PALLAS and verdict.hard)
  # The backward multiplies the cotangent (the forward's output dtype) by
  # w.T: the other collective, with k and n swapped.
  back = kernel_verdict(collective.transpose, rows, n, k,
                        preferred_element_type or dtype, axis_size, device,
                        **options)
  return Choice(Impl.PALLAS, Impl.PALLAS if back is None else back.impl, "",
                False)


def backward_impl(impl: Impl | str, collective: Collective | str,
                  dtype) -> Impl:
  """The implementation a backward pass uses for `collective` on `dtype`.

  The forward's, except that `pallas` becomes `ring` where the Hopper
  kernels do not take `dtype` (an f32 cotangent of an op asked for f32
  results): the backward of a kernel-served op must not fail for it.

  Args:
    impl: the forward's implementation.
    collective: the backward's collective (all_gather or reduce_scatter).
    dtype: the backward operands' dtype.
  """
  impl = Impl.parse(impl, "impl")
  Collective.parse(collective, "collective")
  if impl != Impl.PALLAS:
    return impl
  return (Impl.PALLAS if jnp.dtype(dtype).name in KERNEL_DTYPES
          else Impl.RING)
