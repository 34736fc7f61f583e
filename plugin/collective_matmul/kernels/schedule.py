"""The ring schedule of both kernels: which tile, which k block, when to send.

The kernels trace these same functions on their scalars (so they use only
ops Mosaic GPU lowers); the tests run them on CPU arrays. Plain JAX: no
Pallas, so the selection layer may use the shape rules (`padding`,
`supports_rows_per_batch`) without importing the kernels.
"""
from __future__ import annotations

import dataclasses
import math

from jax import lax
import jax.numpy as jnp

from collective_matmul.kernels.configs import TileConfig


@dataclasses.dataclass(frozen=True)
class Padding:
  """How far each local dimension is padded to fit the tiles."""

  m: int
  k: int
  n: int

  @property
  def any(self) -> bool:
    return bool(self.m or self.k or self.n)


def padding(config: TileConfig, m: int, k: int, n: int) -> Padding:
  up = lambda x, t: -x % t
  return Padding(m=up(m, config.cta_tile_m), k=up(k, config.tile_k),
                 n=up(n, config.cta_tile_n))


def supports_rows_per_batch(config: TileConfig, m: int,
                            rows_per_batch: int) -> bool:
  """Whether the kernel can write `[b, D * s, n]` directly for this shard."""
  return (m % rows_per_batch == 0
          and rows_per_batch % config.cta_tile_m == 0)


def tile_coordinates(linear, m_iters, n_iters):
  """Linear tile index -> (ring step, tile index within the step).

  Steps are outermost so every device works through step s before s + 1:
  all waits point to strictly earlier tiles, so the ring cannot deadlock.
  """
  per_step = m_iters * n_iters
  return lax.div(linear, per_step), lax.rem(linear, per_step)


# ------------------------------------------------- all-gather kernel: sends


def send_plan(k_iters: int, n_iters: int, spread: bool, gap: int = 1):
  """(k blocks per sender, number of senders, steps between sends).

  With `spread`, n-tile j forwards k blocks [j * per, (j + 1) * per), so the
  block is on its way after `per` pipeline steps instead of `k_iters`.
  Without, n-tile 0 forwards all of them (the scheme of JAX's
  `collective_matmul_mgpu.py`).
  """
  if not spread:
    return k_iters, 1, 1
  per = math.ceil(k_iters / n_iters)
  # Every send must fall inside the pipeline: (per - 1) * gap < k_iters.
  gap = max(1, min(gap, (k_iters - 1) // max(per - 1, 1)))
  return per, math.ceil(k_iters / per), gap


def sender_share(n_idx, k_iters: int, per: int):
  """How many k blocks n-tile `n_idx` forwards (0 for non-senders)."""
  return jnp.minimum(jnp.maximum(k_iters - n_idx * per, 0), per)


def is_send_step(kk, n_idx, k_iters: int, per: int, gap: int):
  """Whether n-tile `n_idx` forwards the block it loads at pipeline step
  `kk`: its sends fall at steps 0, gap, 2 * gap, ... while its share lasts.

  The one send predicate: `k_block` places the sent blocks by it and the
  all-gather kernel sends (and waits for its sends) by it.
  """
  share = sender_share(n_idx, k_iters, per)
  return (lax.rem(kk, gap) == 0) & (lax.div(kk, gap) < share)


def k_block(kk, n_idx, k_iters: int, per: int, gap: int):
  """The k block a tile's pipeline loads at step `kk`: a permutation of k.

  N-tile `n_idx` forwards the `share` blocks starting at `n_idx * per`; they
  are placed at its send steps 0, gap, 2 * gap, ... (`is_send_step`, so the
  sends are paced and the tile's own slice of the row block leaves early);
  the other blocks fill the remaining steps in increasing order.
  """
  share = sender_share(n_idx, k_iters, per)
  start = n_idx * per
  in_share = is_send_step(kk, n_idx, k_iters, per, gap)
  shares_so_far = jnp.minimum(lax.div(kk, gap) + 1, share)
  other = kk - shares_so_far
  other = jnp.where(other < start, other, other + share)
  return jnp.where(in_share, start + lax.div(kk, gap), other)


def last_send_step(n_idx, k_iters: int, per: int, gap: int):
  """Pipeline step of a tile's last send (negative when it sends nothing)."""
  return (sender_share(n_idx, k_iters, per) - 1) * gap


def sender_chunk(c, share: int, m_iters: int):
  """Chunk `c` of a sender block's copy loop -> (ring step, row block, j):
  the block forwards its `share` k blocks of every row block, row blocks in
  order, step by step, so row block 0 of a step lands first. Its k block is
  `sender * per + j` (`send_plan(k_iters, sender_sms, True)`)."""
  per_step = m_iters * share
  return (lax.div(c, per_step), lax.rem(lax.div(c, share), m_iters),
          lax.rem(c, share))


@dataclasses.dataclass(frozen=True)
class SenderPlan:
  """How the dedicated sender blocks (`AllGatherConfig.sender_sms`) split a
  ring step's shard into chunks (a CTA row block's `tile_k` columns), in
  which order each forwards its chunks, and what one arrival semaphore
  counts.

  By rows (`k_major=False`): sender s forwards the contiguous k blocks
  [s * per, s * per + share) of every row block, row block by row block;
  a unit of arrival is one row block (`num_senders` signals).
  K-major: sender s forwards k blocks s, s + S, s + 2 S, ... (S senders) of
  every row block, a k group at a time across all row blocks; a unit is
  one k group, k blocks [g * S, (g + 1) * S) (one signal per sender with a
  block in it), which a tile waits for as its pipeline reaches it.
  """

  k_iters: int
  m_iters: int
  sender_sms: int
  k_major: bool

  @property
  def per(self) -> int:
    """By rows: k blocks per sender (the slice length)."""
    return send_plan(self.k_iters, self.sender_sms, True)[0]

  @property
  def num_units(self) -> int:
    """Arrival units (semaphores) per ring step."""
    if self.k_major:
      return -(-self.k_iters // self.sender_sms)
    return self.m_iters

  def share(self, sender):
    """How many k blocks of each row block `sender` forwards."""
    if self.k_major:
      return jnp.maximum(
          lax.div(self.k_iters - sender + self.sender_sms - 1,
                  jnp.int32(self.sender_sms)), 0)
    return sender_share(sender, self.k_iters, self.per)

  def chunks_per_step(self, sender):
    return self.m_iters * self.share(sender)

  def chunk(self, c, sender):
    """Chunk `c` of `sender`'s copy loop -> (ring step, row block i, j),
    its j-th k block (`k_block`); steps in order."""
    share = self.share(sender)
    if not self.k_major:
      return sender_chunk(c, share, self.m_iters)
    per_step = self.m_iters * share
    within = lax.rem(c, per_step)
    return (lax.div(c, per_step), lax.rem(within, self.m_iters),
            lax.div(within, self.m_iters))

  def k_block(self, sender, j):
    if self.k_major:
      return j * self.sender_sms + sender
    return sender * self.per + j

  def unit(self, i, j):
    """The arrival unit (semaphore index within a step) of chunk (i, j)."""
    return j if self.k_major else i

  def opens_unit(self, sender, i, j):
    """Whether chunk (i, j) is `sender`'s first of its unit."""
    del sender  # Every sender forwards every row block.
    return (i if self.k_major else j) == 0

  def closes_unit(self, sender, i, j):
    """Whether chunk (i, j) is `sender`'s last of its unit."""
    if self.k_major:
      return i == self.m_iters - 1
    return j == self.share(sender) - 1

  def unit_signals(self, unit):
    """Signals that complete `unit`: one per sender with chunks in it."""
    if self.k_major:
      return jnp.minimum(jnp.int32(self.sender_sms),
                         self.k_iters - unit * self.sender_sms)
    return send_plan(self.k_iters, self.sender_sms, True)[1]

  def announce_lag(self, in_flight: int) -> int:
    """Chunks after a unit's last store that it is announced, once that
    store has landed: k-major at once, once every store has landed (its
    tiles wait for each group as they reach it, and the drain costs less
    than announcing late); by rows twice the stores in flight, so that
    announcing waits only for stores that old."""
    return 0 if self.k_major else 2 * in_flight


def sender_pipeline(slots: int):
  """(loads ahead, stores in flight) of a sender block's copy loop over
  `slots` shared-memory buffers.

  A remote TMA store holds its buffer until NVLink has read it, so most
  buffers go to stores in flight and the rest to loads (from local HBM,
  faster) ahead. A sending SM's rate is limited per SM, not by this depth
  (docs/TUNING.md, "Senders").
  """
  ahead = max(1, slots // 3)
  return ahead, slots - ahead


def output_row(local_row, source, axis_size: int, rows_per_batch: int):
  """Output row of `local_row` of device `source`'s shard.

  The shard is `[b, s]` rows flattened (s = rows_per_batch); the output is
  `[b, D * s]` flattened, so a row tile within one b stays contiguous.
  """
  batch = lax.div(local_row, rows_per_batch)
  within = lax.rem(local_row, rows_per_batch)
  return (batch * axis_size + source) * rows_per_batch + within


def source_device(device, step, axis_size):
  """Whose shard device `device` multiplies at ring step `step`."""
  return lax.rem(device + step, axis_size)


# --------------------------------------------- reduce-scatter kernel: sends


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


def reduce_scatter_block(device, step, axis_size: int):
  """Row block whose partial sum device `device` works on at ring step `step`.

  (device - step - 1) mod D: the sum for block j starts at device j + 1 and
  moves one device on per step, ending complete on device j at step D - 1.
  """
  return lax.rem(device - step - 1 + 2 * axis_size, axis_size)
