"""Where the ring kernels reach their peers: the one seam between a ring
schedule and the devices it runs on.

A ring kernel asks this seam for its rank on the ring, the blocks it runs
on, its own view of each per-rank array, a peer's view of its receive
buffer, and its semaphores (wait, and signal a peer). Two implementations:

* `DeviceRing`, the product: one rank per device of a mesh axis, inside
  `shard_map`. Each method emits exactly the op the kernels used before
  the seam existed (`lax.axis_index`, `plgpu.remote_ref`, a semaphore
  signal with a `device_id`), so the kernels trace to the same program.
* `VirtualRanks`, the check on one GPU: D ranks inside one launch. The
  launch's blocks are split into D shares (rank r runs on blocks
  [offset_r, offset_r + share_r), its persistent loop sized to its share),
  every per-rank array is stacked on a leading rank axis (rank r's view is
  `stacked.at[r]`), a peer's receive buffer is `stacked.at[peer]`, and
  rank r's semaphores are `sems.at[r]`. Every block of the launch is
  resident (the shares add up to at most one block per SM), so a rank's
  spin-wait on its peer always makes progress. A local and a remote
  signal lower to the same release atomic add, and a TMA store into the
  peer's slice is the same copy as into its NVLink-mapped buffer, so the
  schedule under test is the product's. Test-only knobs inject skew
  (unequal shares, a rank held back by a sleep) and mutations (a named
  wait or signal dropped) to show that the checks can fail.

Sites: every wait and signal names its site, so a mutation can drop
exactly one of them (`SITES`).
"""
from __future__ import annotations

import dataclasses

from jax import lax
import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

# The waits and signals of both kernels, by site (`VirtualRanks.drop`).
SITES = (
    # All-gather, tiles sending from their pipelines.
    "ag_tile_wait",      # a later step's tile waits for its row block
    "ag_tile_signal",    # a tile announces its slices of a row block
    # All-gather, dedicated sender blocks.
    "ag_unit_wait",      # a sender (or a k-major tile) waits for a unit
    "ag_unit_signal",    # a sender announces a unit
    # Reduce-scatter.
    "rs_partial_wait",   # a tile waits for the partial sum it adds to
    "rs_partial_signal", # a warpgroup announces the partial sum it sent
)
# The grid axis of `ring_skeleton.kernel_call`.
GRID_AXIS = "cluster_grid"


def peer_id(axis_name, index):
  """Device id of `index` along `axis_name`, other mesh coordinates kept."""
  mesh = jax.sharding.get_abstract_mesh()
  if len(getattr(mesh, "axis_names", ())) > 1:
    return {axis_name: index}
  return index


@dataclasses.dataclass(frozen=True)
class DeviceRing:
  """One rank per device of `axis_name` (inside `shard_map`)."""

  axis_name: str
  axis_size: int

  stacked = False  # Arrays are per device, not stacked over ranks.

  def launch_blocks(self, sm_count: int) -> int:
    """The blocks of the launch: one per SM."""
    return sm_count

  def start(self):
    """Run first in the kernel (nothing for devices)."""

  def rank(self):
    return lax.axis_index(self.axis_name)

  def block(self):
    """This block's index among its rank's blocks."""
    return lax.axis_index(GRID_AXIS)

  def blocks(self):
    """The blocks of this rank (its persistent loop's stride)."""
    return lax.axis_size(GRID_AXIS)

  def whole_grid(self) -> bool:
    """Whether a rank's blocks are the whole grid (`plgpu.nd_loop` can
    deal the tiles out)."""
    return True

  def local(self, ref):
    """This rank's view of a per-rank array."""
    return ref

  def gather(self, x):
    """Every rank's `x`, stacked in rank order (`[D, ...]`), outside the
    kernel: an all-gather over the axis."""
    return lax.all_gather(x, self.axis_name)

  def remote(self, ref, peer):
    """Rank `peer`'s view of a per-rank array (its receive buffer)."""
    return plgpu.remote_ref(ref, peer_id(self.axis_name, peer))

  def semaphores(self, shape):
    """This launch's semaphores, `shape` per rank, zeroed at launch."""
    return pl.get_global(plgpu.SemaphoreType.REGULAR(shape))

  def wait(self, sems, index, count, site):
    """Waits until this rank's `sems[index]` reaches `count` (not
    decremented: several waiters read one count)."""
    del site
    pl.semaphore_wait(sems.at[index], count, decrement=False)

  def signal(self, sems, index, peer, site):
    """Adds one to rank `peer`'s `sems[index]`."""
    del site
    pl.semaphore_signal(sems.at[index],
                        device_id=peer_id(self.axis_name, peer))


@dataclasses.dataclass(frozen=True)
class VirtualRanks:
  """`axis_size` ranks in one launch on one GPU (see the module doc).

  Attributes:
    axis_size: D, the ranks.
    shares: blocks of each rank (D entries; they may differ, to skew the
      ranks); their sum must not exceed the GPU's SMs.
    delay_ns: per rank, nanoseconds its blocks sleep before starting
      (skew); () for none.
    drop: sites (`SITES`) whose waits or signals are left out: a
      test-only mutation, WRONG RESULTS or a hang by design.
  """

  axis_size: int
  shares: tuple[int, ...]
  delay_ns: tuple[int, ...] = ()
  drop: frozenset[str] = frozenset()

  stacked = True  # Every per-rank array has a leading rank axis.

  def __post_init__(self):
    if self.axis_size < 2:
      raise ValueError(f"VirtualRanks needs >= 2 ranks, got {self.axis_size}")
    if len(self.shares) != self.axis_size or min(self.shares) < 1:
      raise ValueError(f"shares={self.shares}: one positive block count per "
                       f"rank ({self.axis_size})")
    if self.delay_ns and len(self.delay_ns) != self.axis_size:
      raise ValueError(f"delay_ns={self.delay_ns}: one per rank")
    unknown = set(self.drop) - set(SITES)
    if unknown:
      raise ValueError(f"drop={sorted(unknown)}: not among {SITES}")

  @classmethod
  def even(cls, axis_size: int, sm_count: int, **kwargs) -> "VirtualRanks":
    """D equal shares of `sm_count` SMs."""
    return cls(axis_size, (sm_count // axis_size,) * axis_size, **kwargs)

  def launch_blocks(self, sm_count: int) -> int:
    if sum(self.shares) > sm_count:
      raise ValueError(f"shares {self.shares} exceed the {sm_count} SMs: "
                       "every block must be resident")
    return sum(self.shares)

  def _offsets(self):
    offsets, total = [], 0
    for share in self.shares:
      offsets.append(total)
      total += share
    return offsets

  def _grid_block(self):
    return lax.axis_index(GRID_AXIS)

  def rank(self):
    block = self._grid_block()
    rank = jnp.int32(0)
    for offset in self._offsets()[1:]:
      rank = rank + (block >= offset).astype(jnp.int32)
    return rank

  def _pick(self, values):
    """`values[rank]`, for a static list of ints."""
    rank = self.rank()
    out = jnp.int32(values[0])
    for r, value in enumerate(values[1:], start=1):
      out = jnp.where(rank == r, jnp.int32(value), out)
    return out

  def block(self):
    return self._grid_block() - self._pick(self._offsets())

  def blocks(self):
    return self._pick(list(self.shares))

  def whole_grid(self) -> bool:
    return False

  def start(self):
    if not any(self.delay_ns):
      return
    rank = self.rank()
    for r, nanos in enumerate(self.delay_ns):
      if nanos:
        @pl.when(rank == r)
        def _hold_back():
          # nanosleep sleeps at most about 1 ms a call.
          @pl.loop(0, -(-nanos // 500_000))
          def _sleep(_):
            pl.delay(500_000)

  def local(self, ref):
    return ref.at[self.rank()]

  def gather(self, x):
    """Every rank's `x` stacked in rank order: virtual ranks' arrays
    already are."""
    return x

  def remote(self, ref, peer):
    return ref.at[peer]

  def semaphores(self, shape):
    return pl.get_global(
        plgpu.SemaphoreType.REGULAR((self.axis_size, *shape)))

  def wait(self, sems, index, count, site):
    if site in self.drop:
      return
    pl.semaphore_wait(sems.at[(self.rank(), *index)], count, decrement=False)

  def signal(self, sems, index, peer, site):
    if site in self.drop:
      return
    pl.semaphore_signal(sems.at[(peer, *index)])


def check_stacked(ranks, **operands):
  """Checks a virtual-ranks entry point's arguments: `ranks` a
  `VirtualRanks`, each operand stacked over its ranks (`[D, ...]`, 3-D)."""
  if not isinstance(ranks, VirtualRanks):
    raise TypeError(f"ranks={ranks!r} must be a peers.VirtualRanks")
  if any(x.ndim != 3 or x.shape[0] != ranks.axis_size
         for x in operands.values()):
    shapes = ", ".join(f"{name} {x.shape}" for name, x in operands.items())
    raise ValueError(f"expected {' and '.join(operands)} stacked over "
                     f"{ranks.axis_size} ranks ([D, ...], 3-D), got {shapes}")
