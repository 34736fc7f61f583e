"""Matmul-reduce-scatter for Hopper in Pallas Mosaic GPU.

`psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)` over a
mesh axis of D devices joined by NVLink, run inside `shard_map`: x holds all
rows and this device's slice of the contraction, w the matching rows of the
weight. A ring: at step s device d computes the partial product of row block
(d - s - 1) mod D, adds the partial sum device d - 1 computed for that block
one step earlier, and sends the sum on to device d + 1 (TMA stores from the
epilogue's shared memory straight into the peer's buffer, one semaphore per
output tile), so after D steps device d holds the full sum of its own block.
Partial sums travel in the output dtype (as NCCL's reduce-scatter does) and
are accumulated in float32 registers within a device; each hop adds
in the output dtype. One persistent loop covers the tiles
of all D steps; a tile waits only for its own partial sum. Only plain
peer-to-peer TMA stores cross NVLink (no NVLS multicast).

Overlap details:
* a tile's partial sum stays in the epilogue's shared memory and is sent
  during the *next* tile's k loop, in `send_pieces` row pieces per slot,
  one every `send_gap` steps (`spread_sends`): a long remote store holds
  the SM's TMA unit and the pipeline's loads queue behind it, so no SM
  sends much at once;
* its arrival is announced `send_gap` steps after its last send, still
  inside that k loop (wait for the stores, then signal; after it where the
  loop is too short: `schedule.partial_announce_step`),
  so the peer finds it landed when its own loop ends, and no warpgroup
  waits on NVLink while it could compute; a block's last tile sends and
  announces from its own epilogue;
* a tile that receives starts loading the partial sum while its last
  wgmma drains;
* pipeline slots are released without delay (nothing is forwarded from
  them), so 3 stages prefetch as deep as the all-gather kernel's 4 and the
  shared memory of the fourth holds a whole-tile epilogue.
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
from collective_matmul.kernels import ring_skeleton
from collective_matmul.kernels import schedule
from collective_matmul.kernels import tracing
from collective_matmul.kernels.configs import ReduceScatterConfig


def _ring_kernel(x_ref, w_ref, *refs, ring, config: ReduceScatterConfig,
                 m_block, k, n, rows_per_batch, diagnostic_loopback,
                 weight_k_major=False,
                 scales=ring_skeleton.ScaleOperands()):
  """The shared skeleton (`ring_skeleton.ring_tile_loop`) with the
  reduce-scatter's hooks: a tile's k loop sends (and announces) the previous
  tile's partial sum, and its epilogue adds the partial sum it received and
  sends the sum on, or stores it once complete. `refs`: the scales given
  (`scales`; rows numbered as x's), the output, the receive buffer
  (D > 1). `ring`: the ranks' seam (`peers`), through which every peer is
  reached. Each device scales its own partial product before it is cast,
  summed and sent."""
  ring.start()
  axis_size = ring.axis_size
  scale_refs, (out_ref, *maybe_scratch) = scales.split(refs)
  x_ref, w_ref, out_ref = map(ring.local, (x_ref, w_ref, out_ref))
  scale_refs = scale_refs._replace(
      **{name: ring.local(ref) for name, ref in
         (("rows", scale_refs.rows), ("cols", scale_refs.cols))
         if ref is not None})
  scratch_all = maybe_scratch[0] if maybe_scratch else None
  out_dtype = out_ref.dtype
  cta_tile_m, cta_tile_n = config.cta_tile_m, config.cta_tile_n
  grid = ring_skeleton.tile_grid(config, axis_size, m_block, k, n)
  k_iters = grid.k_iters
  num_epi = len(grid.epi_tiles)
  multi = axis_size > 1
  wg_idx = grid.wg_idx
  if multi:
    dev = ring.rank()
    send_to = lax.rem(dev + 1, axis_size)
    if diagnostic_loopback:  # Diagnostics only: wrong results.
      send_to = dev
    scratch_ref = ring.local(scratch_all)
    peer_scratch = ring.remote(scratch_all, send_to)
    # landed[s, i, j]: warpgroups whose half of tile (i, j)'s step-s partial
    # sum reached this device's scratch slot s (with `pingpong` the one
    # warpgroup that ran the whole tile: `Tile.warpgroups`).
    landed = ring.semaphores((axis_size - 1, grid.m_iters, grid.n_iters))
  else:
    dev = 0
    scratch_ref = None

  # With the whole warpgroup tile in the two epilogue slots, a tile's
  # partial sum leaves during the next tile's k loop, one row piece
  # every `send_gap` steps (paced like the all-gather kernel's sends),
  # not all at once from the epilogue, where every SM would store at
  # the same moment and the next tile's loads would wait behind it.
  defer = multi and config.spread_sends and num_epi <= 2
  # (epilogue slot, row piece, pipeline step) of each deferred send.
  pieces = config.send_pieces
  piece_m = config.epi_tile_m // pieces
  send_plan = [(j // pieces, j % pieces, step) for j, step in enumerate(
      schedule.partial_send_steps(k_iters, num_epi * pieces,
                                  config.send_gap))]
  # Where the previous tile's partial sum is announced: inside the next
  # k loop once its stores had `send_gap` steps to land, else after it.
  announce_step = (schedule.partial_announce_step(
      k_iters, len(send_plan), config.send_gap, defer)
                   if multi else None)

  def announce(step, m_idx, n_idx):
    """Signals the peer once this warpgroup's stores of a tile landed."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
    ring.signal(landed, (step, m_idx, n_idx), send_to, "rs_partial_signal")

  def x_row(m_idx, block):
    """The first of x's rows a tile of `block` multiplies."""
    return schedule.output_row(m_idx * cta_tile_m, block, axis_size,
                               rows_per_batch)

  def row_block(step, m_idx):
    """Whose partial sum the tile works on; it is written to the tile's
    rows of the output (or of the peer's scratch)."""
    block = schedule.reduce_scatter_block(dev, step, axis_size)
    return block, pl.ds(m_idx * cta_tile_m, cta_tile_m)

  def begin_tile(tile: ring_skeleton.Tile) -> ring_skeleton.TileHooks:
    step, m_idx, n_idx = tile.step, tile.m_idx, tile.n_idx
    tile_rows, cta_n = tile.out_rows, tile.cta_n
    wg_m, wg_n = tile.wg_m, tile.wg_n
    received = tile.scratch["received"]
    loop_info = tile.loop_info
    # This warpgroup's tiles: every one of the block's, or with `pingpong`
    # every other one (`Tile.stride`); its partial sums wait in its own
    # epilogue slots until its next tile's k loop sends them.
    stride = tile.stride
    is_last = (loop_info.local_index == loop_info.num_local_steps - 1
               if stride == 1 else
               loop_info.local_index >= loop_info.num_local_steps - stride)
    if multi:
      blocks = ring.blocks()
      prev_step, prev_m, prev_n = grid.coordinates(
          loop_info.index[0] - (blocks if stride == 1 else stride * blocks))
      # This warpgroup's previous tile left a partial sum to send.
      prev_sends = ((loop_info.local_index > stride - 1)
                    & (prev_step < axis_size - 1))

    def peer_slot(step, m_idx, n_idx, i):
      return (peer_scratch.at[step, pl.ds(m_idx * cta_tile_m, cta_tile_m),
                              pl.ds(n_idx * cta_tile_n, cta_tile_n)]
              .at[wg_m, wg_n].at[grid.epi_slice(i)])

    def load_partial(i):
      """Starts loading the received partial sum of epilogue tile i."""
      plgpu.copy_gmem_to_smem(
          scratch_ref.at[step - 1, tile_rows, cta_n].at[wg_m, wg_n]
          .at[grid.epi_slice(i)], tile.slot(i),
          received.at[wg_idx * 2 + i % 2])

    def wait_partial(i):
      plgpu.barrier_wait(received.at[wg_idx * 2 + i % 2])

    partial_sum = ring_skeleton.Received(load=load_partial, wait=wait_partial)

    def epilogue(acc_ref):
      if multi and announce_step is None:
        # The previous tile's stores to the peer had this tile's whole
        # k loop to land: announce them only now, so that waiting for
        # NVLink never stalls the tensor cores.
        @pl.when(prev_sends)
        def _announce_previous():
          announce(prev_step, prev_m, prev_n)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      if multi:
        # The received partial sum starts loading while the last wgmma
        # drains.
        @pl.when(step > 0)
        def _receive_partial():
          with tracing.phase("wait_partial_sum"):
            ring.wait(landed, (step - 1, m_idx, n_idx), tile.warpgroups,
                      "rs_partial_wait")
          for i in range(min(2, num_epi)):
            load_partial(i)

      acc = tile.accumulator(acc_ref)

      def to_peer(src, epi):
        send = lambda: plgpu.copy_smem_to_gmem(
            src, peer_scratch.at[step, tile_rows, cta_n].at[wg_m, wg_n]
            .at[epi])
        if defer:  # The next tile's k loop sends it; the last has none.
          pl.when(is_last)(send)
        else:
          send()

      if not multi:
        tile.store_accumulator(acc, tile.to_output)
        return

      @pl.when(step == 0)
      def _first():
        tile.store_accumulator(acc, to_peer)

      @pl.when((step > 0) & (step < axis_size - 1))
      def _middle():
        tile.store_accumulator(acc, to_peer, received=partial_sum)

      @pl.when(step == axis_size - 1)
      def _last():
        tile.store_accumulator(acc, tile.to_output, received=partial_sum)

      # This block's last tile has no next one to announce it.
      @pl.when((step < axis_size - 1) & is_last)
      def _announce_last():
        announce(step, m_idx, n_idx)

    def send_previous(kk, a_smem):
      del a_smem  # Nothing is forwarded from the pipeline.
      if defer:
        for i, piece, send_step in send_plan:
          rows = pl.ds(piece * piece_m, piece_m)
          @pl.when(prev_sends & (kk == send_step))
          def _send_previous():
            plgpu.copy_smem_to_gmem(
                tile.slot(i).at[rows],
                peer_slot(prev_step, prev_m, prev_n, i).at[rows])
      if announce_step is not None:
        @pl.when(prev_sends & (kk == announce_step))
        def _announce_previous():
          announce(prev_step, prev_m, prev_n)

    def run(matmul):
      matmul(x_ref, x_row(m_idx, tile.block))

    return ring_skeleton.TileHooks(run=run, k_step=send_previous,
                                   epilogue=epilogue)

  ring_skeleton.ring_tile_loop(
      grid, x_ref, w_ref, out_ref, ring=ring, row_block=row_block,
      begin_tile=begin_tile, delay_release=0,
      scratch=dict(received=plgpu.Barrier(num_barriers=4)),
      weight_k_major=weight_k_major, scales=scale_refs,
      scale_row=lambda step, m_idx, block: x_row(m_idx, block))


def matmul_reduce_scatter(x, w, axis_name, *, config: ReduceScatterConfig,
                          out_dtype=None, rows_per_batch: int | None = None,
                          weight_layout: str = "kn", scale=None,
                          row_scale=None, col_scale=None):
  """`psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)`.

  Call inside `shard_map` over `axis_name`.
  `diagnostics.loopback` wraps it for benchmarks (WRONG RESULTS).

  Args:
    x: `[D * m, k]`: all rows, this device's slice of the contraction;
      bf16 or f16, or fp8 (e4m3 or e5m2, `configs.FP8_PAIRS`).
    w: `[k, n]`, the matching rows of the weight, same dtype; or with
      `weight_layout="nk"` given K-major, `[n, k]` (fp8 needs it, e4m3: for
      `dy @ w.T` the weight stored `[k_model, n_model]` already is).
    axis_name: mesh axis of the ring (NVLink peers).
    config: tiling and send pacing (`selection.select_reduce_scatter_config`
      picks one for a shape).
    out_dtype: result (and partial-sum) dtype: x's (default; bf16 for fp8
      operands) or float32.
    rows_per_batch: when x is `[b, D * s, k]` scattered on the middle
      dimension and flattened, pass `s`: row block d is then rows
      `[:, d * s:(d + 1) * s]` and the result is `[b, s, n]` flattened, with
      no transposes. `s` must be a multiple of the CTA tile rows.
    weight_layout: "kn" (`w` is `[k, n]`) or "nk" (`[n, k]`, K-major).
    scale: None, or an f32 scalar (shape `()`, the same on every device)
      that each device's partial product is multiplied by, in f32, before
      it is cast and summed: the product of fp8 operands' scales. fp8
      needs `config.tile_k` 128 (`configs.fp8_reason`).
    row_scale: None, or `[D * m]` f32, the scales of this device's x rows
      (rowwise fp8): row i of its partial product is multiplied by
      `row_scale[i]`.
    col_scale: None, or `[n]` f32, the scales of this device's w columns:
      column j of its partial product is multiplied by `col_scale[j]`.
      Every scale given multiplies the device's f32 partial product before
      it is cast, summed and sent on: the result is the sum over devices
      of `(x @ w) * scale * row_scale[:, None] * col_scale[None, :]`.

  Returns:
    `[m, n]`: row block `axis_index` of the sum over devices.
  """
  return _launch(x, w, peers.DeviceRing(axis_name, lax.axis_size(axis_name)),
                 config=config, out_dtype=out_dtype,
                 rows_per_batch=rows_per_batch, weight_layout=weight_layout,
                 scale=scale, row_scale=row_scale, col_scale=col_scale,
                 axis_label=repr(axis_name))


def matmul_reduce_scatter_virtual(x, w, ranks: peers.VirtualRanks, *,
                                  config: ReduceScatterConfig,
                                  out_dtype=None,
                                  rows_per_batch: int | None = None,
                                  weight_layout: str = "kn", scale=None,
                                  row_scale=None, col_scale=None):
  """The reduce-scatter ring as `ranks.axis_size` virtual ranks in one launch
  on one GPU (`peers.VirtualRanks`): the product's kernel and schedule,
  each peer a slice of stacked arrays. For checking the ring on one GPU;
  the product calls `matmul_reduce_scatter` inside `shard_map`.

  Args:
    x: `[D, D * m, k]`, rank r's slice of the contraction at `x[r]`.
    w: `[D, k, n]` (or `[D, n, k]` with `weight_layout="nk"`).
    ranks, config, out_dtype, rows_per_batch, weight_layout, scale: as
      `matmul_reduce_scatter` (the scale is shared by every rank).
    row_scale: None, or `[D, D * m]` f32, rank r's x rows' scales at `[r]`.
    col_scale: None, or `[D, n]` f32, rank r's w columns' scales at `[r]`.

  Returns:
    `[D, m, n]`: rank r's row block of the sum at `[r]`.
  """
  peers.check_stacked(ranks, x=x, w=w)
  return _launch(x, w, ranks, config=config, out_dtype=out_dtype,
                 rows_per_batch=rows_per_batch, weight_layout=weight_layout,
                 scale=scale, row_scale=row_scale, col_scale=col_scale,
                 axis_label="the virtual ranks")


def _launch(x, w, ring, *, config: ReduceScatterConfig, out_dtype,
            rows_per_batch, weight_layout, scale, row_scale, col_scale,
            axis_label):
  """Checks, pads and runs the kernel on `ring` (`peers`; with virtual
  ranks every array has a leading rank axis); returns the output."""
  lead = x.shape[:1] if ring.stacked else ()
  keep = ((0, 0),) * len(lead)  # No padding of the rank axis.
  weight_k_major = ring_skeleton.weight_k_major(weight_layout)
  ring_skeleton.check_scale(scale)
  ring_skeleton.check_vector_scales(row_scale, col_scale,
                                    out_dtype=out_dtype)
  out_dtype = ring_skeleton.check_operands(
      ring_skeleton.per_rank(x, ring), ring_skeleton.per_rank(w, ring),
      out_dtype, names=("x", "w"), k_major=weight_k_major, tile_k=config.tile_k)
  rows, k = x.shape[-2:]
  n = w.shape[-2] if weight_k_major else w.shape[-1]
  ring_skeleton.check_vector_scales(
      row_scale, col_scale, rows=rows, cols=n, lead=lead,
      row_meaning="row of x", col_meaning="column of w")
  axis_size = ring.axis_size
  if rows % axis_size:
    raise ValueError(f"x has {rows} rows, not divisible by the {axis_size} "
                     f"devices of {axis_label}")
  m = rows // axis_size
  ring_skeleton.check_config(config, ReduceScatterConfig)
  ring_skeleton.check_axis(config, axis_size)
  batch_major = rows_per_batch is not None and rows_per_batch != m
  pad, rows_per_batch = ring_skeleton.tile_plan(config, m, k, n, x.dtype,
                                                out_dtype, rows_per_batch)
  if batch_major and pad.any:
    raise ValueError(f"rows_per_batch needs k={k} and n={n} to fit the "
                     f"tiles of {config}")
  # The output's last columns may be left to TMA; the receive buffer,
  # written and read only by the kernels, keeps whole tiles.
  pad_n = 0 if ring_skeleton.clips_columns(
      config, n, out_dtype, *(() if weight_k_major else (w.dtype,))) else pad.n
  if pad.m or pad.k:
    x = jnp.pad(x.reshape(*lead, axis_size, m, k),
                keep + ((0, 0), (0, pad.m), (0, pad.k)))
    x = x.reshape(*lead, axis_size * (m + pad.m), k + pad.k)
  if pad_n or pad.k:
    w = jnp.pad(w, keep + (((0, pad_n), (0, pad.k)) if weight_k_major else
                           ((0, pad.k), (0, pad_n))))
  m_block, k_pad = m + pad.m, k + pad.k
  n_pad = n + pad.n
  out_types = [jax.ShapeDtypeStruct((*lead, m_block, n + pad_n), out_dtype)]
  if axis_size > 1:
    # Receive buffer: slot s holds the partial sum for ring step s + 1.
    out_types.append(jax.ShapeDtypeStruct(
        (*lead, axis_size - 1, m_block, n_pad), out_dtype))
  kernel = ring_skeleton.kernel_call(
      functools.partial(_ring_kernel, ring=ring, config=config,
                        m_block=m_block, k=k_pad, n=n_pad,
                        rows_per_batch=rows_per_batch,
                        diagnostic_loopback=diagnostics.loopback_active(),
                        weight_k_major=weight_k_major,
                        scales=ring_skeleton.ScaleOperands.of(
                            scale, row_scale, col_scale)),
      out_types, ring)

  def rows_as_x(row_scale):
    """The row scales padded as x's row blocks are."""
    if not pad.m:
      return row_scale
    return jnp.pad(row_scale.reshape(*lead, axis_size, m),
                   keep + ((0, 0), (0, pad.m))).reshape(*lead, -1)

  scales = ring_skeleton.scale_operands(
      scale, row_scale, col_scale, rows_pad=rows_as_x, cols_pad=pad.n,
      lead=lead)
  out = kernel(x, w, *scales)[0]
  return out[..., :m, :n] if (pad.m or pad_n) else out
