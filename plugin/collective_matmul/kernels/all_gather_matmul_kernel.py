"""All-gather-LHS matmul for Hopper in Pallas Mosaic GPU.

`all_gather(lhs) @ rhs` over a mesh axis of D devices joined by NVLink, run
inside `shard_map`. A ring: at step s device d multiplies shard (d + s) % D
by its rhs columns while forwarding that shard to device d - 1, straight
from the shared memory the matmul pipeline loaded it into (TMA copies to the
peer's scratch buffer), with a semaphore per (step, row block) announcing
arrival. Compared with JAX's collective matmul example
(`jax/experimental/pallas/ops/gpu/collective_matmul_mgpu.py`):

* one persistent loop over the tiles of all D steps: no barrier of all
  threads, no wait for every SM's signal and no tail wave between steps;
  a tile waits only for its own row block;
* a row block is forwarded by all its n-tiles, each sending a slice of k
  first in its pipeline (`spread_sends`), and each sender signals as soon as
  its slice has landed, so the next step's data arrives early;
* or (`AllGatherConfig.sender_sms`) a few blocks only forward, with a copy
  loop of their own, while the others only multiply: where a ring step's
  tiles leave SMs idle anyway (`selection` picks it for such shapes);
  k-major (`k_major_sends`), the senders deliver one k group at a time
  across all row blocks and a later step's tile waits for each group as
  its pipeline loads it, so it starts as soon as the first group is in.

Only plain peer-to-peer TMA stores cross NVLink (no NVLS multicast).
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from collective_matmul.kernels import configs
from collective_matmul.kernels import diagnostics
from collective_matmul.kernels import peers
from collective_matmul.kernels import pipeline
from collective_matmul.kernels import ring_skeleton
from collective_matmul.kernels import schedule
from collective_matmul.kernels import tracing
from collective_matmul.kernels.configs import AllGatherConfig


def _ring_kernel(lhs_local_ref, rhs_ref, *refs, ring, config: AllGatherConfig,
                 m_shard, k, n, rows_per_batch, diagnostic_loopback,
                 weight_k_major=False,
                 scales=ring_skeleton.ScaleOperands()):
  """The shared skeleton (`ring_skeleton.ring_tile_loop`) with the
  all-gather's hooks. Who forwards the shard to the next device:

  * the tiles (no `config.sender_sms`): every n-tile of a row block sends a
    slice of its k blocks from its pipeline, and a later step's tile waits
    for its whole row block;
  * dedicated sender blocks (`_forward_loop`), the others only multiply; by
    rows, a later step's tile waits for its row block; k-major, its memory
    warpgroup waits for each k group as it loads it.

  `refs`: the scales given (`scales`: the row scales every rank's, the
  rows of shard j at `[j * m_shard, (j + 1) * m_shard)`), the output, the
  receive buffer (D > 1). `ring`: the ranks' seam (`peers`), through
  which every peer is reached.
  """
  ring.start()
  axis_size = ring.axis_size
  scale_refs, (out_ref, *maybe_scratch) = scales.split(refs)
  lhs_local_ref, rhs_ref, out_ref = map(ring.local,
                                        (lhs_local_ref, rhs_ref, out_ref))
  if scale_refs.cols is not None:
    scale_refs = scale_refs._replace(cols=ring.local(scale_refs.cols))
  scratch_all = maybe_scratch[0] if maybe_scratch else None
  cta_tile_m, tile_k = config.cta_tile_m, config.tile_k
  grid = ring_skeleton.tile_grid(config, axis_size, m_shard, k, n)
  k_iters = grid.k_iters
  multi = axis_size > 1
  sender_sms = config.sender_sms if multi else 0
  # Whether the compute tiles forward the shard from their pipelines.
  tiles_send = multi and not sender_sms
  if sender_sms:
    plan = schedule.SenderPlan(k_iters, grid.m_iters, sender_sms,
                               config.k_major_sends)
  if tiles_send:
    per_sender, num_senders, send_gap = schedule.send_plan(
        k_iters, grid.n_iters, config.spread_sends, config.send_gap)
  # A tile's pipeline slots are released at once where it forwards nothing
  # from them, or waits for its sends' reads in the same k step
  # (`eager_release`); else one step late.
  eager = config.eager_release or not tiles_send

  if multi:
    dev, send_to = ring_skeleton.ring_neighbours(ring)
    if diagnostic_loopback:  # Diagnostics only: wrong results.
      send_to = dev
    scratch_ref = ring.local(scratch_all)
    peer_scratch = ring.remote(scratch_all, send_to)
    # arrived[s, u]: the tiles (senders) whose part of unit u for step
    # s + 1 landed; a unit is a row block, or with k-major senders a k
    # group.
    units = plan.num_units if sender_sms else grid.m_iters
    arrived = ring.semaphores((axis_size - 1, units))
  else:
    dev = 0
    scratch_ref = None

  def scale_row(step, m_idx, source):
    """Where the tile's rows start among every shard's row scales."""
    del step
    return source * m_shard + m_idx * cta_tile_m

  def row_block(step, m_idx):
    """Whose shard the tile multiplies, and where its rows go."""
    source = schedule.source_device(dev, step, axis_size)
    return source, pl.ds(
        schedule.output_row(m_idx * cta_tile_m, source, axis_size,
                            rows_per_batch), cta_tile_m)

  def k_order(kk, n_idx):
    """The k block a tile loads at pipeline step kk: its forwarded blocks
    first (at its send steps), the others in order."""
    return schedule.k_block(kk, n_idx, k_iters, per_sender, send_gap)

  def begin_tile(tile: ring_skeleton.Tile) -> ring_skeleton.TileHooks:
    step, m_idx, n_idx = tile.step, tile.m_idx, tile.n_idx
    first_row = m_idx * cta_tile_m  # Of the tile, in its source shard.

    def run(matmul):
      """Step 0 multiplies the local shard, a later step the slot the
      previous device filled (`wait_row_block` and `before_load` wait)."""
      @pl.when(step == 0)
      def _local():
        matmul(lhs_local_ref, first_row)

      if multi:
        @pl.when(step > 0)
        def _received():
          wait_row_block()
          matmul(scratch_ref.at[step - 1], first_row)

    if not multi:
      return ring_skeleton.TileHooks(run=run)
    k_major = sender_sms and plan.k_major

    def wait_row_block():
      """Without k-major senders a later step's tile waits until its whole
      row block has landed."""
      if not k_major:
        signals = plan.unit_signals(m_idx) if sender_sms else num_senders
        with tracing.phase("wait_arrival"):
          ring.wait(arrived, (step - 1, m_idx), signals,
                    "ag_unit_wait" if sender_sms else "ag_tile_wait")

    def wait_k_group(kk):
      """K-major: before a later step's tile loads k block kk, the first of
      a k group, waits until every sender's part of that group landed."""
      @pl.when((step > 0) & (lax.rem(kk, sender_sms) == 0))
      def _wait():
        group = lax.div(kk, jnp.int32(sender_sms))
        ring.wait(arrived, (step - 1, group), plan.unit_signals(group),
                  "ag_unit_wait")

    if not tiles_send:
      return ring_skeleton.TileHooks(
          run=run, before_load=wait_k_group if k_major else None)

    share = schedule.sender_share(n_idx, k_iters, per_sender)
    forwards = (step < axis_size - 1) & (share > 0)
    last_send = schedule.last_send_step(n_idx, k_iters, per_sender, send_gap)
    # Announce once the last slice has had `send_gap` steps to land.
    signal_at = jnp.minimum(last_send + send_gap, k_iters - 1)

    def forward_slices(kk, a_smem):
      sender = forwards & (grid.wg_idx == tile.lead_wg)
      sends_now = schedule.is_send_step(kk, n_idx, k_iters, per_sender,
                                        send_gap)
      if not eager:
        sent_before = (kk > 0) & schedule.is_send_step(
            kk - 1, n_idx, k_iters, per_sender, send_gap)

        # The slot of step kk - 1 is released when this body returns
        # (delay_release=1): its send must have finished reading it.
        @pl.when(sender & sent_before)
        def _slot_read():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      @pl.when(sender & sends_now)
      def _forward():
        plgpu.copy_smem_to_gmem(
            a_smem,
            peer_scratch.at[step, pl.ds(first_row, cta_tile_m),
                            pl.ds(k_order(kk, n_idx) * tile_k, tile_k)])
        if eager:  # The slot is released when this body returns.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      @pl.when(sender & (kk == signal_at))
      def _announce():
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        ring.signal(arrived, (step, m_idx), send_to, "ag_tile_signal")

    return ring_skeleton.TileHooks(run=run, k_step=forward_slices)

  loop = functools.partial(
      ring_skeleton.ring_tile_loop, grid, lhs_local_ref, rhs_ref, out_ref,
      ring=ring, row_block=row_block, begin_tile=begin_tile,
      delay_release=0 if eager else 1,
      k_order=k_order if tiles_send else None, weight_k_major=weight_k_major,
      scales=scale_refs, scale_row=scale_row)
  if not sender_sms:
    loop()
    return

  compute_blocks = ring.blocks() - sender_sms
  block = ring.block()

  @pl.when(block < compute_blocks)
  def _compute():
    loop(num_blocks=compute_blocks)

  @pl.when(block >= compute_blocks)
  def _send():
    _forward_loop(block - compute_blocks, lhs_local_ref, scratch_ref,
                  peer_scratch, arrived, send_to=send_to, ring=ring,
                  config=config, plan=plan, wg_idx=grid.wg_idx)


def _forward_loop(sender, lhs_local_ref, scratch_ref, peer_scratch, arrived, *,
                  send_to, ring, config: AllGatherConfig,
                  plan: schedule.SenderPlan, wg_idx):
  """A sender block's copy loop: its k blocks of every row block of every
  ring step, in `plan`'s order, TMA-loaded from the local shard (step 0)
  or from the slot the previous device filled (later steps, once every
  sender's part of that arrival unit arrived) and TMA-stored into the next
  device's scratch (`schedule.sender_pipeline`: loads ahead and stores in
  flight). Each (step, unit) is announced once this block's stores of it
  have landed. Runs on warpgroup 0; the others have nothing to do."""
  cta_tile_m, tile_k = config.cta_tile_m, config.tile_k
  dtype = lhs_local_ref.dtype
  slots = config.sender_slots(jnp.dtype(dtype).itemsize)
  ahead, in_flight = schedule.sender_pipeline(slots)
  lag = plan.announce_lag(in_flight)
  num_chunks = (ring.axis_size - 1) * plan.chunks_per_step(sender)

  def chunk(c):
    step, i, j = plan.chunk(c, sender)
    return step, i, j, pl.ds(i * cta_tile_m, cta_tile_m), pl.ds(
        plan.k_block(sender, j) * tile_k, tile_k)

  @functools.partial(
      pl.run_scoped,
      buf=plgpu.SMEM((slots, cta_tile_m, tile_k), dtype,
                     transforms=pipeline.swizzled(dtype, tile_k)),
      loaded=plgpu.Barrier(num_arrivals=1, num_barriers=slots),
      collective_axes="wg",
  )
  def _scope(buf, loaded):
    @pl.when(wg_idx == 0)
    def _sender():
      def load(c):
        step, i, j, rows, cols = chunk(c)
        slot = lax.rem(c, slots)

        @pl.when(step == 0)
        def _local():
          plgpu.copy_gmem_to_smem(lhs_local_ref.at[rows, cols],
                                  buf.at[slot], loaded.at[slot])

        @pl.when(step > 0)
        def _received():
          @pl.when(plan.opens_unit(sender, i, j))
          def _wait():  # Each unit of a later step once.
            unit = plan.unit(i, j)
            ring.wait(arrived, (step - 1, unit), plan.unit_signals(unit),
                      "ag_unit_wait")
          plgpu.copy_gmem_to_smem(scratch_ref.at[step - 1, rows, cols],
                                  buf.at[slot], loaded.at[slot])

      def announce(step, i, j):
        ring.signal(arrived, (step, plan.unit(i, j)), send_to,
                    "ag_unit_signal")

      for c in range(ahead):  # The prologue: the first loads.
        pl.when(c < num_chunks)(functools.partial(load, c))

      @pl.loop(0, num_chunks)
      def _chunk(c):
        step, _, _, rows, cols = chunk(c)
        slot = lax.rem(c, slots)
        plgpu.barrier_wait(loaded.at[slot])
        plgpu.copy_smem_to_gmem(buf.at[slot], peer_scratch.at[step, rows,
                                                              cols])

        # A unit whose last chunk is c - lag is announced once that store
        # (and so every older one) has landed.
        @pl.when(c >= lag)
        def _landed():
          old_step, i, j, _, _ = chunk(c - lag)

          @pl.when(plan.closes_unit(sender, i, j))
          def _closes():
            plgpu.wait_smem_to_gmem(lag, wait_read_only=False)
            announce(old_step, i, j)

        # Chunk c + ahead goes where chunk c - in_flight was: once that
        # store has read it (at most `in_flight` newer stores pending).
        plgpu.wait_smem_to_gmem(in_flight, wait_read_only=True)

        @pl.when(c + ahead < num_chunks)
        def _refill():
          load(c + ahead)

      plgpu.wait_smem_to_gmem(0, wait_read_only=False)

      @pl.loop(jnp.maximum(num_chunks - lag, 0), num_chunks)
      def _tail(c):
        step, i, j, _, _ = chunk(c)
        pl.when(plan.closes_unit(sender, i, j))(
            functools.partial(announce, step, i, j))


def all_gather_lhs_matmul(lhs, rhs, axis_name, *, config: AllGatherConfig,
                          out_dtype=None, rows_per_batch: int | None = None,
                          return_gathered: bool = False,
                          weight_layout: str = "kn", scale=None,
                          row_scale=None, col_scale=None):
  """`all_gather(lhs, axis_name, tiled=True) @ rhs` on Hopper GPUs.

  Call inside `shard_map` over `axis_name`. Rows and k that do not fit the
  tiles are zero-padded and the padding sliced off; columns are left to TMA
  where the rows allow (`ring_skeleton.clips_columns`), else padded too.
  `diagnostics.loopback` wraps it for benchmarks (WRONG RESULTS).

  Args:
    lhs: local rows `[m, k]`, bf16 or f16, or fp8 (e4m3 or e5m2,
      `configs.FP8_PAIRS`; gathered as fp8 bytes).
    rhs: local columns `[k, n]`, same dtype; or with `weight_layout="nk"`
      given K-major, `[n, k]` (fp8 needs it, e4m3).
    axis_name: mesh axis of the ring (its devices must be NVLink peers).
    config: tiling and send pacing (`selection.select_config` picks one
      for a shape).
    out_dtype: result dtype: lhs's (default; bf16 for fp8 operands) or
      float32.
    rows_per_batch: when lhs is `[b, s, k]` gathered on `s` and flattened to
      `[b * s, k]`, pass `s`: the result is then written directly in the
      `[b, D * s, n]` order (flattened), with no transposes. Needs `s` to be
      a multiple of the CTA tile rows (see `supports_rows_per_batch`).

    return_gathered: also return `all_gather(lhs)` `[D, m, k]` (blocks in
      axis-index order), assembled from the shards the ring delivered, so a
      backward pass need not gather again.
    weight_layout: "kn" (`rhs` is `[k, n]`) or "nk" (`[n, k]`, K-major).
    scale: None, or an f32 scalar (shape `()`) the f32 accumulator is
      multiplied by before it is cast: the product of fp8 operands'
      scales. fp8 needs `config.tile_k` 128 (`configs.fp8_reason`).
    row_scale: None, or `[m]` f32, the scales of this device's lhs rows
      (rowwise fp8): the gathered result's row i of shard j is multiplied
      by shard j's `row_scale[i]`. Gathered from every device before the
      kernel (`_launch` says why), `[D, m]` f32 in all.
    col_scale: None, or `[n]` f32, the scales of this device's rhs
      columns: column j of the result is multiplied by `col_scale[j]`.
      With `scale` too, the accumulator is multiplied by all three, in
      f32, before the cast.

  Returns:
    `[D * m, n]`: device blocks in axis-index order, or with `rows_per_batch`
    the flattened `[b, D * s, n]`; with `return_gathered` a pair.
  """
  shard = lhs.shape  # `[m, k]` (`_launch` checks it).
  ring = peers.DeviceRing(axis_name, lax.axis_size(axis_name))
  out, lhs, received = _launch(lhs, rhs, ring, config=config,
                               out_dtype=out_dtype,
                               rows_per_batch=rows_per_batch,
                               weight_layout=weight_layout, scale=scale,
                               row_scale=row_scale, col_scale=col_scale)
  if not return_gathered:
    return out
  # Slot s of the scratch holds shard (d + s + 1) % D: rotate into order.
  held = lhs[None] if ring.axis_size == 1 else jnp.concatenate(
      [lhs[None], received], axis=0)
  if ring.axis_size > 1:
    held = jnp.roll(held, lax.axis_index(axis_name), axis=0)
  return out, held[:, :shard[0], :shard[1]]


def all_gather_lhs_matmul_virtual(lhs, rhs, ranks: peers.VirtualRanks, *,
                                  config: AllGatherConfig, out_dtype=None,
                                  rows_per_batch: int | None = None,
                                  weight_layout: str = "kn", scale=None,
                                  row_scale=None, col_scale=None):
  """The all-gather ring as `ranks.axis_size` virtual ranks in one launch on
  one GPU (`peers.VirtualRanks`): the product's kernel and schedule, each
  peer a slice of stacked arrays. For checking the ring on one GPU; the
  product calls `all_gather_lhs_matmul` inside `shard_map`.

  Args:
    lhs: `[D, m, k]`, rank r's rows at `lhs[r]`.
    rhs: `[D, k, n]` (or `[D, n, k]` with `weight_layout="nk"`), rank r's
      columns.
    ranks, config, out_dtype, rows_per_batch, weight_layout, scale: as
      `all_gather_lhs_matmul` (the scale is shared by every rank).
    row_scale: None, or `[D, m]` f32, rank r's rows' scales at `[r]` (as
      `all_gather_lhs_matmul` gathers them).
    col_scale: None, or `[D, n]` f32, rank r's columns' scales at `[r]`.

  Returns:
    `[D, D * m, n]`: rank r's output at `[r]`.
  """
  peers.check_stacked(ranks, lhs=lhs, rhs=rhs)
  return _launch(lhs, rhs, ranks, config=config, out_dtype=out_dtype,
                 rows_per_batch=rows_per_batch, weight_layout=weight_layout,
                 scale=scale, row_scale=row_scale, col_scale=col_scale)[0]


def _launch(lhs, rhs, ring, *, config: AllGatherConfig, out_dtype,
            rows_per_batch, weight_layout, scale, row_scale, col_scale):
  """Checks, pads and runs the kernel on `ring` (`peers`; with virtual
  ranks every array has a leading rank axis); returns (the output, the
  padded lhs, the receive buffer or None).

  Row scales are gathered before the kernel (`ring.gather`), not carried
  around the ring with their rows: they are 4 bytes a row against the
  row's k operand bytes, so a separate gather moves next to nothing,
  while carrying them would add a second payload to each of the three
  send schemes (the tiles' k slices, by-rows and k-major senders) and to
  the arrival each announces, changing the ring's synchronisation for
  every config. Each tile reads its shard's slice of the gathered
  scales in its epilogue."""
  lead = lhs.shape[:1] if ring.stacked else ()
  keep = ((0, 0),) * len(lead)  # No padding of the rank axis.
  weight_k_major = ring_skeleton.weight_k_major(weight_layout)
  ring_skeleton.check_scale(scale)
  ring_skeleton.check_vector_scales(row_scale, col_scale,
                                    out_dtype=out_dtype)
  out_dtype = ring_skeleton.check_operands(
      ring_skeleton.per_rank(lhs, ring), ring_skeleton.per_rank(rhs, ring),
      out_dtype, k_major=weight_k_major, tile_k=config.tile_k)
  m, k = lhs.shape[-2:]
  n = rhs.shape[-2] if weight_k_major else rhs.shape[-1]
  ring_skeleton.check_vector_scales(
      row_scale, col_scale, rows=m, cols=n, lead=lead,
      row_meaning="row of lhs", col_meaning="column of rhs")
  axis_size = ring.axis_size
  ring_skeleton.check_config(config, AllGatherConfig)
  ring_skeleton.check_axis(config, axis_size)
  if config.sender_sms >= configs.sm_count():
    raise ValueError(
        f"sender_sms={config.sender_sms} leaves no block to multiply on "
        f"{configs.sm_count()} SMs")
  pad, rows_per_batch = ring_skeleton.tile_plan(config, m, k, n, lhs.dtype,
                                                out_dtype, rows_per_batch)
  pad_n = 0 if ring_skeleton.clips_columns(
      config, n, out_dtype,
      *(() if weight_k_major else (rhs.dtype,))) else pad.n
  if pad.m or pad.k:
    lhs = jnp.pad(lhs, keep + ((0, pad.m), (0, pad.k)))
  if pad_n or pad.k:
    rhs = jnp.pad(rhs, keep + (((0, pad_n), (0, pad.k)) if weight_k_major else
                               ((0, pad.k), (0, pad_n))))
  m_shard, k_pad = lhs.shape[-2:]
  n_out = n + pad_n  # The tiles cover n + pad.n.
  out_types = [jax.ShapeDtypeStruct((*lead, axis_size * m_shard, n_out),
                                    out_dtype)]
  if axis_size > 1:
    # Receive buffer: slot s holds the shard used at ring step s + 1.
    out_types.append(jax.ShapeDtypeStruct(
        (*lead, axis_size - 1, m_shard, k_pad), lhs.dtype))
  kernel = ring_skeleton.kernel_call(
      functools.partial(_ring_kernel, ring=ring, config=config,
                        m_shard=m_shard, k=k_pad, n=n + pad.n,
                        rows_per_batch=rows_per_batch,
                        diagnostic_loopback=diagnostics.loopback_active(),
                        weight_k_major=weight_k_major,
                        scales=ring_skeleton.ScaleOperands.of(
                            scale, row_scale, col_scale)),
      out_types, ring)

  def every_shards_rows(row_scale):
    """`[D * m_shard]`: every rank's row scales, each padded as its shard."""
    rows = ring.gather(row_scale)
    if pad.m:
      rows = jnp.pad(rows, ((0, 0), (0, pad.m)))
    return rows.reshape(axis_size * m_shard)

  scales = ring_skeleton.scale_operands(
      scale, row_scale, col_scale, rows_pad=every_shards_rows,
      cols_pad=pad.n, lead=lead)
  results = kernel(lhs, rhs, *scales)
  out = results[0]
  if pad.m or pad_n:
    out = out.reshape(*lead, axis_size, m_shard, n_out)[..., :m, :n]
    out = out.reshape(*lead, axis_size * m, n)
  return out, lhs, results[1] if axis_size > 1 else None
