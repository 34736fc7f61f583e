"""The kernels' tuning configurations: frozen dataclasses, validated up front.

One config class per kernel on a shared tile base. No Pallas (and JAX only
inside `sm_count`), so the selection layer builds, stores and compares
configs without importing the kernels. Also the hardware facts and operand
rules the kernels check against, which the selection layer applies too.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from collective_matmul.enums import MatmulDimension

# The operand dtypes the Hopper kernels take (numpy dtype names).
KERNEL_DTYPES = ("bfloat16", "float16")
# The SMs of an H100 or H200 (SXM): the count where JAX names none (tracing
# the kernels on CPU).
DEFAULT_SM_COUNT = 132
SMEM_BYTES = 232_448  # Per-block shared memory on sm_90.
SMEM_RESERVE = 1024  # Barriers and bookkeeping.
# Chunks in flight per sender block (`AllGatherConfig.sender_sms`).
MAX_SENDER_SLOTS = 12


def sm_count(device=None) -> int:
  """The SMs of `device`: the blocks a persistent kernel launches.

  `device`: an abstract mesh's `abstract_device` (its `num_cores`) or a JAX
  device (its `core_count`); None: the current abstract mesh's. Where that
  names no count, the first of `jax.devices()`'s `core_count`, else
  `DEFAULT_SM_COUNT` (off GPU, e.g. tracing the kernels on CPU).
  """
  import jax  # pylint: disable=g-import-not-at-top  # Only here (see above).
  if device is None:
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device",
                     None)
  cores = (getattr(device, "num_cores", None)
           or getattr(device, "core_count", None))
  if cores:
    return cores
  return getattr(jax.devices()[0], "core_count", None) or DEFAULT_SM_COUNT


def dtype_reason(dtype, out_dtype=None) -> str | None:
  """Why the kernels cannot take operands of `dtype` with results of
  `out_dtype` (None: the operands' dtype), or None if they can: bf16 or f16
  operands, results in the operands' dtype or float32."""
  name = np.dtype(dtype).name
  if name not in KERNEL_DTYPES:
    return f"dtype {name} (kernel takes bf16 or f16)"
  if out_dtype is not None and np.dtype(out_dtype).name not in (name,
                                                                "float32"):
    return (f"preferred_element_type {np.dtype(out_dtype).name} (kernel "
            f"gives {name} or float32)")
  return None


# fp8 operand pairs the kernels take (lhs, rhs; numpy dtype names): e4m3 x
# e4m3 (a forward product) and e5m2 x e4m3 (a gradient times a weight).
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
FP8_PAIRS = (("float8_e4m3fn", "float8_e4m3fn"),
             ("float8_e5m2", "float8_e4m3fn"))
# Results of an fp8 product (the accumulator, scaled, in this dtype).
FP8_OUT_DTYPES = ("bfloat16", "float32")
# The k step of an fp8 pipeline: 8-bit wgmma operands are read K-major from
# shared memory, whose 128-byte swizzle holds 128 fp8 elements of k.
FP8_TILE_K = 128


def is_fp8(dtype) -> bool:
  """Whether `dtype` is fp8 (e4m3 or e5m2): the one test of it in the
  package. JAX promotes neither implicitly; which pairs the kernels take
  is `fp8_reason`'s."""
  return np.dtype(dtype).name in FP8_DTYPES


def fp8_reason(lhs_dtype, rhs_dtype, out_dtype, weight_k_major: bool,
               tile_k: int) -> str | None:
  """Why the kernels cannot take fp8 operands `lhs_dtype` x `rhs_dtype`
  with results of `out_dtype` (None: bf16), the weight K-major ([n, k],
  `weight_k_major`) or not, in k steps of `tile_k`; None if they can."""
  pair = (np.dtype(lhs_dtype).name, np.dtype(rhs_dtype).name)
  if pair not in FP8_PAIRS:
    allowed = ", ".join(f"{a} x {b}" for a, b in FP8_PAIRS)
    return f"fp8 operands {pair[0]} x {pair[1]} (kernel takes {allowed})"
  out = np.dtype(out_dtype or "bfloat16").name
  if out not in FP8_OUT_DTYPES:
    return (f"preferred_element_type {out} of an fp8 product (kernel gives "
            "bfloat16 or float32)")
  if not weight_k_major:
    return ("an fp8 weight given [k, n]: 8-bit wgmma operands are read "
            "K-major, pass it as [n, k] (weight_layout='nk')")
  if tile_k != FP8_TILE_K:
    return (f"tile_k={tile_k} with fp8 operands (the 128-byte swizzle holds "
            f"{FP8_TILE_K} fp8 elements of k: tile_k={FP8_TILE_K})")
  return None


def axis_reason(config, axis_size: int) -> str | None:
  """Why `config` cannot run on an axis of `axis_size` devices, or None:
  ping-pong warpgroups (`TileConfig.pingpong`) in the all-gather's ring
  need its tiles to free each slot at once where they forward from it
  (`eager_release`), or dedicated senders."""
  if axis_size == 1:
    return None
  if (config.pingpong and getattr(config, "sender_sms", None) == 0
      and not config.eager_release):
    return (f"pingpong=True in the all-gather's ring ({axis_size} devices) "
            "needs eager_release=True or sender_sms > 0: its tiles forward "
            "the shard from pipeline slots that ping-pong frees at once")
  return None


# `TileConfig` fields added after configs were first stored (tuned tables,
# autotune caches, the selection tests' decision grid), with their defaults:
# `to_json` leaves them out at those defaults.
LATER_FIELDS = {"epi_slots": 2, "pingpong": False}
# Fields removed since configs were first stored, each with the one value
# the kernels now always take (`REMOVED_FIELDS`): a stored entry that names
# one at that value reads as before, without it (`selection.tuned`).
# `cluster_dimension`: 2-block clusters sharing an operand by TMA multicast
# (lost in every measurement, docs/TUNING.md); `grid_minor_dim`: the tile
# order's minor dimension, always m; `sender_announce_lag`: the senders'
# announcement lag, always the schedule's (`SenderPlan.announce_lag`);
# `early_announce`: the reduce-scatter announces a partial sum inside the
# next tile's k loop, always.
REMOVED_FIELDS = {"cluster_dimension": None, "grid_minor_dim": "m",
                  "sender_announce_lag": None, "early_announce": True}


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Tiling and pipeline of the warp-specialized matmul both kernels run.

  Attributes:
    tile_m, tile_n, tile_k: one compute warpgroup's output tile and the k
      step of the pipeline.
    max_concurrent_steps: shared-memory pipeline depth (>= 2).
    wg_dimension: `MatmulDimension` N or M ("n" or "m"): the two compute
      warpgroups split the CTA tile along this dimension (so the CTA tile
      is 2x tile along it).
    grid_tile_width: order of output tiles within one ring step (a planar
      snake, m its minor dimension, in bands this many tiles wide, for L2
      reuse).
    epi_tile_m, epi_tile_n: epilogue store granularity.
    epi_slots: shared-memory epilogue slots per warpgroup: 2 (default),
      epilogue tile i goes through slot i % 2; or 1, where the epilogue
      tile is the whole warpgroup tile (one store per tile, no wait for a
      slot, and the shared memory of one slot less).
    chain_tiles: a block's tiles share one pipeline, so the next tile's
      first k blocks load while this one's last steps and epilogue run
      (where the pipeline releases slots at once and k_iters is a multiple
      of `max_concurrent_steps`); False: each tile's pipeline starts with
      a prologue once the previous one's slots are all consumed.
    pingpong: the two compute warpgroups take turns on whole CTA tiles
      instead of splitting each (a block's tiles alternate between them,
      `wg_dimension` does not apply: the CTA tile is `tile_m` x `tile_n`),
      so one warpgroup's epilogue runs while the other's k loop keeps the
      tensor cores busy. Both read one ring of `max_concurrent_steps`
      slots, loaded in tile order (needs `chain_tiles`); the tile's owner
      frees each slot a step late (one stage less prefetch). In the rings
      the tile's owner sends and announces what the tile forwards
      (`axis_reason`: the all-gather's tiles then need `eager_release`, or
      dedicated senders).
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int = 4
  wg_dimension: MatmulDimension = MatmulDimension.N
  grid_tile_width: int = 8
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  chain_tiles: bool = False
  epi_slots: int = 2
  pingpong: bool = False

  def __post_init__(self):
    # "m" / "n" (as tuned tables and caches store them) become members.
    object.__setattr__(self, "wg_dimension",
                       MatmulDimension.parse(self.wg_dimension,
                                             "wg_dimension"))
    for value, name in ((self.tile_m, "tile_m"), (self.tile_n, "tile_n"),
                        (self.epi_tile_m, "epi_tile_m"),
                        (self.epi_tile_n, "epi_tile_n")):
      if value <= 0 or value % 64:
        raise ValueError(f"{name}={value} must be a positive multiple of 64")
    if self.tile_k not in (32, 64, 128):
      raise ValueError(f"{self.tile_k=} must be 32, 64 or 128")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"{self.max_concurrent_steps=} must be >= 2")
    if self.epi_slots not in (1, 2):
      raise ValueError(f"{self.epi_slots=} must be 1 or 2")
    if self.epi_slots == 1 and (self.epi_tile_m, self.epi_tile_n) != (
        self.tile_m, self.tile_n):
      raise ValueError(
          f"epi_slots=1 needs the epilogue tile {self.epi_tile_m}x"
          f"{self.epi_tile_n} to be the whole tile {self.tile_m}x{self.tile_n}")
    if self.grid_tile_width < 1:
      raise ValueError(f"{self.grid_tile_width=} must be >= 1")
    if self.tile_m % self.epi_tile_m or self.tile_n % self.epi_tile_n:
      raise ValueError(
          f"epilogue tile {self.epi_tile_m}x{self.epi_tile_n} must divide the "
          f"tile {self.tile_m}x{self.tile_n}")
    if self.pingpong and not self.chain_tiles:
      raise ValueError("pingpong=True needs chain_tiles=True (the warpgroups' "
                       "tiles are loaded into one ring of slots, in order)")

  @property
  def cta_tile_m(self) -> int:
    return self.tile_m * (2 if self.splits("m") else 1)

  @property
  def cta_tile_n(self) -> int:
    return self.tile_n * (2 if self.splits("n") else 1)

  def splits(self, dimension) -> bool:
    """Whether the two compute warpgroups split the CTA tile along
    `dimension` ("m" / "n"): `wg_dimension`, unless `pingpong`."""
    return not self.pingpong and self.wg_dimension == dimension

  def smem_bytes(self, itemsize: int, out_itemsize: int) -> int:
    """Shared memory the kernel allocates per block."""
    pipeline = self.max_concurrent_steps * self.tile_k * (
        self.cta_tile_m + self.cta_tile_n) * itemsize
    epilogue = (2 * self.epi_slots * self.epi_tile_m * self.epi_tile_n
                * out_itemsize)
    return pipeline + epilogue + SMEM_RESERVE

  def fit_shared_memory(self, itemsize: int, out_itemsize: int):
    """This config with as many pipeline stages (at most its own) as fit a
    block's shared memory with operands and results of these element sizes
    (bytes), or None where not even 2 stages fit."""
    for stages in range(self.max_concurrent_steps, 1, -1):
      fitted = dataclasses.replace(self, max_concurrent_steps=stages)
      if fitted.smem_bytes(itemsize, out_itemsize) <= SMEM_BYTES:
        return fitted
    return None

  def tile_fields(self) -> dict[str, Any]:
    """The `TileConfig` fields of this config (to build another kernel's)."""
    return {f.name: getattr(self, f.name)
            for f in dataclasses.fields(TileConfig)}

  def to_json(self) -> dict[str, Any]:
    """The fields, as stored in the tuned tables and caches. Fields added
    since (`LATER_FIELDS`) are written only where they differ from their
    defaults, so a config from before serialises as it always did (a field
    left out takes its default when read back)."""
    out = dataclasses.asdict(self)
    for name, default in LATER_FIELDS.items():
      if out.get(name, default) == default:
        out.pop(name, None)
    return out


def _check_send_gap(send_gap):
  if send_gap < 1:
    raise ValueError(f"send_gap={send_gap} must be >= 1")


@dataclasses.dataclass(frozen=True)
class AllGatherConfig(TileConfig):
  """The all-gather-LHS matmul kernel's config (`all_gather_lhs_matmul`).

  Attributes:
    spread_sends: every n-tile of a row block forwards its own slice of k,
      first thing in its pipeline, so a whole block reaches the next device
      in a fraction of a tile's time (instead of only at the end of the
      block's first tile). False: n-tile 0 forwards the whole block.
    send_gap: pipeline steps between two forwarded k blocks of one tile. A
      send holds its shared-memory pipeline slot until NVLink has read it;
      with every SM sending at once, back-to-back sends would stall the
      pipeline on the link.
    sender_sms: 0, or the number of blocks (one per SM) that only forward
      the shards around the ring, with a TMA copy loop of their own
      (`sender_slots` chunks in flight), while the other blocks only
      multiply, their pipelines releasing slots at once. Worth it where the
      tiles of a ring step leave SMs idle anyway (e.g. 128 tiles on 132
      SMs); `spread_sends` and `send_gap` do not apply then.
    k_major_sends: with `sender_sms`, the senders deliver the shard one
      k group at a time across all its row blocks (sender j forwards k
      blocks j, j + sender_sms, ...; a group is one k block of each
      sender), and a tile of a later ring step waits for each group as its
      pipeline loads it, not for its whole row block up front. Where a ring
      step is one wave, the next step's tiles then start as soon as the
      first groups are in, and the transfer only has to stay ahead of
      their k loops. False: row block by row block, each sender a
      contiguous slice of k.
    eager_release: a tile that forwards a k block waits for its send to
      have read the pipeline slot in the same k step (behind that step's
      wgmma), so slots are released at once and the pipeline prefetches
      `max_concurrent_steps` deep, and the tiles' pipelines can be chained
      (`chain_tiles`); False: the slot is released one step late (one
      stage less prefetch).
  """

  spread_sends: bool = True
  send_gap: int = 12
  sender_sms: int = 0
  k_major_sends: bool = False
  eager_release: bool = False

  def __post_init__(self):
    super().__post_init__()
    _check_send_gap(self.send_gap)
    if self.sender_sms < 0:
      raise ValueError(f"sender_sms={self.sender_sms} must be >= 0")
    if self.k_major_sends and not self.sender_sms:
      raise ValueError("k_major_sends=True needs sender_sms > 0 (it orders "
                       "the dedicated senders' copies)")

  @property
  def sender_chunk_elems(self) -> int:
    """Elements of one forwarded chunk (a CTA row block's `tile_k`
    columns), the unit of the sender blocks' copy loop."""
    return self.cta_tile_m * self.tile_k

  def sender_slots(self, itemsize: int) -> int:
    """Chunks a sender block keeps in flight: as many as fit in its shared
    memory, at most `MAX_SENDER_SLOTS`."""
    chunk = self.sender_chunk_elems * itemsize
    return max(2, min(MAX_SENDER_SLOTS, (SMEM_BYTES - SMEM_RESERVE) // chunk))


@dataclasses.dataclass(frozen=True)
class ReduceScatterConfig(TileConfig):
  """The matmul-reduce-scatter kernel's config (`matmul_reduce_scatter`).

  Attributes:
    spread_sends: a tile's partial sum is sent during the next tile's k
      loop, one store every `send_gap` steps, instead of all at once from
      its epilogue (needs the whole warpgroup tile in the two epilogue
      slots, see `selection.select_reduce_scatter_config`).
    send_gap: pipeline steps between two stores of the previous tile's
      partial sum (epilogue slots x `send_pieces`) sent from the next
      tile's k loop, and between the last of them and its announcement
      (`schedule.partial_announce_step`: inside that k loop, so the peer's
      epilogue finds it landed rather than waiting for a loop that ends at
      the same moment as its own).
    send_pieces: each epilogue slot of a partial sum leaves in this many row
      pieces, `send_gap` steps apart, so that no store holds the SM's TMA
      unit long (a multiple-of-8-row split of `epi_tile_m`).
  """

  spread_sends: bool = True
  send_gap: int = 12
  send_pieces: int = 1

  def __post_init__(self):
    super().__post_init__()
    _check_send_gap(self.send_gap)
    if (self.send_pieces < 1 or self.epi_tile_m % self.send_pieces
        or (self.epi_tile_m // self.send_pieces) % 8):
      raise ValueError(
          f"send_pieces={self.send_pieces} must split epi_tile_m="
          f"{self.epi_tile_m} into pieces of a multiple of 8 rows")
