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

Overlap details (measured in benchmarks/RESULTS.md):
* a tile's partial sum stays in the epilogue's shared memory and is sent
  during the *next* tile's k loop, in `send_pieces` row pieces per slot,
  one every `send_gap` steps (`spread_sends`): a long remote store holds
  the SM's TMA unit and the pipeline's loads queue behind it, so no SM
  sends much at once;
* its arrival is announced `send_gap` steps after its last send, still
  inside that k loop (`early_announce`; wait for the stores, then signal),
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

from collective_matmul.kernels import common
from collective_matmul.kernels import schedule
from collective_matmul.kernels.configs import ReduceScatterConfig


def _ring_kernel(x_ref, w_ref, out_ref, *maybe_scratch, axis_name, axis_size,
                 config: ReduceScatterConfig, m_block, k, n, rows_per_batch,
                 diagnostic_loopback):
  scratch_ref = maybe_scratch[0] if maybe_scratch else None
  dtype, out_dtype = x_ref.dtype, out_ref.dtype
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  cta_tile_m, cta_tile_n = config.cta_tile_m, config.cta_tile_n
  m_iters, n_iters, k_iters = m_block // cta_tile_m, n // cta_tile_n, k // tile_k
  epi_m, epi_n = config.epi_tile_m, config.epi_tile_n
  split_m = config.wg_dimension == "m"
  ring = axis_size > 1
  wg_idx = lax.axis_index("wg")
  if ring:
    dev = lax.axis_index(axis_name)
    send_to = lax.rem(dev + 1, axis_size)
    if diagnostic_loopback:  # Diagnostics only: wrong results.
      send_to = dev
    peer_scratch = plgpu.remote_ref(scratch_ref,
                                    common.peer_id(axis_name, send_to))
    # landed[s, i, j]: warpgroups whose half of tile (i, j)'s step-s partial
    # sum reached this device's scratch slot s.
    landed = pl.get_global(plgpu.SemaphoreType.REGULAR(
        (axis_size - 1, m_iters, n_iters)))
  else:
    dev = 0

  def make_pipeline(body, compute_context):
    return common.matmul_pipeline(
        body, compute_context, cta_tile_m=cta_tile_m, cta_tile_n=cta_tile_n,
        tile_k=tile_k, k_iters=k_iters, dtype=dtype,
        max_concurrent_steps=config.max_concurrent_steps, delay_release=0)

  ignore = lambda *_, **__: None
  allocs = make_pipeline(ignore, ignore).get_allocations(
      x_ref.at[pl.ds(0, cta_tile_m), :], w_ref.at[:, pl.ds(0, cta_tile_n)])

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=allocs,
      out_smem=plgpu.SMEM((2, 2, epi_m, epi_n), out_dtype,
                          transforms=common.swizzled(out_dtype, epi_n)),
      received=plgpu.Barrier(num_barriers=4),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem, received):
    def coordinates(linear):
      step, in_step = schedule.tile_coordinates(linear, m_iters, n_iters)
      m_idx, n_idx = plgpu.planar_snake(
          in_step, (m_iters, n_iters), 0 if config.grid_minor_dim == "m" else 1,
          config.grid_tile_width)
      return step, m_idx, n_idx

    def announce(step, m_idx, n_idx):
      """Signals the peer once this warpgroup's stores of a tile landed."""
      plgpu.wait_smem_to_gmem(0, wait_read_only=False)
      pl.semaphore_signal(landed.at[step, m_idx, n_idx],
                          device_id=common.peer_id(axis_name, send_to))

    @plgpu.nd_loop((axis_size * m_iters * n_iters,),
                   collective_axes="cluster_grid")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      (linear,) = loop_info.index
      step, m_idx, n_idx = coordinates(linear)
      block = schedule.reduce_scatter_block(dev, step, axis_size)
      tile_rows = pl.ds(m_idx * cta_tile_m, cta_tile_m)
      cta_n = pl.ds(n_idx * cta_tile_n, cta_tile_n)
      wg_m = pl.ds(wg_idx * tile_m, tile_m) if split_m else slice(None)
      wg_n = slice(None) if split_m else pl.ds(wg_idx * tile_n, tile_n)
      epi_tiles = [(mi, ni) for mi in range(tile_m // epi_m)
                   for ni in range(tile_n // epi_n)]

      def epi_slice(i):
        mi, ni = epi_tiles[i]
        return (pl.ds(mi * epi_m, epi_m), pl.ds(ni * epi_n, epi_n))

      def epi_part(acc, i):
        mi, ni = epi_tiles[i]
        return acc[mi * epi_m:(mi + 1) * epi_m, ni * epi_n:(ni + 1) * epi_n]

      # With the whole warpgroup tile in the two epilogue slots, a tile's
      # partial sum leaves during the next tile's k loop, one row piece
      # every `send_gap` steps (paced like the all-gather kernel's sends),
      # not all at once from the epilogue, where every SM would store at
      # the same moment and the next tile's loads would wait behind it.
      defer = ring and config.spread_sends and len(epi_tiles) <= 2
      # (epilogue slot, row piece, pipeline step) of each deferred send.
      pieces = config.send_pieces
      piece_m = epi_m // pieces
      send_plan = [(j // pieces, j % pieces, step) for j, step in enumerate(
          schedule.partial_send_steps(k_iters, len(epi_tiles) * pieces,
                                      config.send_gap))]
      is_last = loop_info.local_index == loop_info.num_local_steps - 1
      # Where the previous tile's partial sum is announced: inside this k
      # loop once its stores had `send_gap` steps to land, else after it.
      announce_step = (schedule.partial_announce_step(
          k_iters, len(send_plan), config.send_gap, defer)
                       if ring and config.early_announce else None)
      if ring:
        prev_step, prev_m, prev_n = coordinates(
            linear - lax.axis_size("cluster_grid"))
        # The previous tile (this block's) left a partial sum to send.
        prev_sends = (loop_info.local_index > 0) & (prev_step < axis_size - 1)

      def peer_slot(step, m_idx, n_idx, i):
        return (peer_scratch.at[step, pl.ds(m_idx * cta_tile_m, cta_tile_m),
                                pl.ds(n_idx * cta_tile_n, cta_tile_n)]
                .at[wg_m, wg_n].at[epi_slice(i)])

      def load_partial(i):
        """Starts loading the received partial sum of epilogue tile i."""
        plgpu.copy_gmem_to_smem(
            scratch_ref.at[step - 1, tile_rows, cta_n].at[wg_m, wg_n]
            .at[epi_slice(i)], out_smem.at[wg_idx, i % 2],
            received.at[wg_idx * 2 + i % 2])

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped,
                           acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          eval_pipeline(acc_ref)
          if ring and announce_step is None:
            # The previous tile's stores to the peer had this tile's whole
            # k loop to land: announce them only now, so that waiting for
            # NVLink never stalls the tensor cores.
            @pl.when(prev_sends)
            def _announce_previous():
              announce(prev_step, prev_m, prev_n)

          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          if ring:
            # The received partial sum starts loading while the last wgmma
            # drains.
            @pl.when(step > 0)
            def _receive_partial():
              pl.semaphore_wait(landed.at[step - 1, m_idx, n_idx], 2,
                                decrement=False)
              for i in range(min(2, len(epi_tiles))):
                load_partial(i)

          acc = acc_ref[...].astype(out_dtype)

          def run_epilogue(receive, store):
            for i in range(len(epi_tiles)):
              slot = i % 2
              if receive:
                plgpu.barrier_wait(received.at[wg_idx * 2 + slot])
                out_smem[wg_idx, slot] += epi_part(acc, i)
              else:
                if i >= 2:  # Slot i % 2 held tile i - 2: that store read it.
                  plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                out_smem[wg_idx, slot] = epi_part(acc, i)
              plgpu.commit_smem()
              store(out_smem.at[wg_idx, slot], epi_slice(i))
              if receive and i + 2 < len(epi_tiles):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                load_partial(i + 2)

          def to_output(src, epi):
            plgpu.copy_smem_to_gmem(
                src, out_ref.at[tile_rows, cta_n].at[wg_m, wg_n].at[epi])

          def to_peer(src, epi):
            send = lambda: plgpu.copy_smem_to_gmem(
                src, peer_scratch.at[step, tile_rows, cta_n].at[wg_m, wg_n]
                .at[epi])
            if defer:  # The next tile's k loop sends it; the last has none.
              pl.when(is_last)(send)
            else:
              send()

          if not ring:
            run_epilogue(False, to_output)
            return

          @pl.when(step == 0)
          def _first():
            run_epilogue(False, to_peer)

          @pl.when((step > 0) & (step < axis_size - 1))
          def _middle():
            run_epilogue(True, to_peer)

          @pl.when(step == axis_size - 1)
          def _last():
            run_epilogue(True, to_output)

          # This block's last tile has no next one to announce it.
          @pl.when((step < axis_size - 1) & is_last)
          def _announce_last():
            announce(step, m_idx, n_idx)

      def mma_body(idxs, a_smem, b_smem, acc_ref):
        plgpu.wgmma(acc_ref, a_smem.at[wg_m], b_smem.at[:, wg_n])
        (kk,) = idxs
        if defer:
          for i, piece, send_step in send_plan:
            rows = pl.ds(piece * piece_m, piece_m)
            @pl.when(prev_sends & (kk == send_step))
            def _send_previous():
              plgpu.copy_smem_to_gmem(
                  out_smem.at[wg_idx, i].at[rows],
                  peer_slot(prev_step, prev_m, prev_n, i).at[rows])
        if announce_step is not None:
          @pl.when(prev_sends & (kk == announce_step))
          def _announce_previous():
            announce(prev_step, prev_m, prev_n)
        plgpu.wgmma_wait(1)
        return acc_ref

      make_pipeline(mma_body, compute_context)(
          x_ref.at[pl.ds(schedule.output_row(m_idx * cta_tile_m, block,
                                             axis_size, rows_per_batch),
                         cta_tile_m), :],
          w_ref.at[:, cta_n],
          allocations=pipeline_allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def matmul_reduce_scatter(x, w, axis_name, *, config: ReduceScatterConfig,
                          out_dtype=None, rows_per_batch: int | None = None,
                          _diagnostic_loopback: bool = False):
  """`psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)`.

  Call inside `shard_map` over `axis_name`.

  Args:
    x: `[D * m, k]`: all rows, this device's slice of the contraction;
      bf16 or f16.
    w: `[k, n]`, the matching rows of the weight, same dtype.
    axis_name: mesh axis of the ring (NVLink peers).
    config: tiling and send pacing (`selection.select_reduce_scatter_config`
      picks one for a shape).
    out_dtype: result (and partial-sum) dtype: x's (default) or float32.
    rows_per_batch: when x is `[b, D * s, k]` scattered on the middle
      dimension and flattened, pass `s`: row block d is then rows
      `[:, d * s:(d + 1) * s]` and the result is `[b, s, n]` flattened, with
      no transposes. `s` must be a multiple of the CTA tile rows.
    _diagnostic_loopback: diagnostics only, WRONG RESULTS for D > 1: every
      device sends its partial sums to its own scratch instead of its
      neighbour's, so the kernel does the same work without NVLink traffic
      (to time what the link costs, `"loopback": true` in
      `scripts/bench_kernels.py`'s config JSON).

  Returns:
    `[m, n]`: row block `axis_index` of the sum over devices.
  """
  out_dtype = common.check_operands(x, w, out_dtype, names=("x", "w"))
  rows, k = x.shape
  n = w.shape[1]
  axis_size = lax.axis_size(axis_name)
  if rows % axis_size:
    raise ValueError(f"x has {rows} rows, not divisible by the {axis_size} "
                     f"devices of {axis_name!r}")
  m = rows // axis_size
  common.check_config(config, ReduceScatterConfig)
  batch_major = rows_per_batch is not None and rows_per_batch != m
  pad, rows_per_batch = common.tile_plan(config, m, k, n, x.dtype, out_dtype,
                                         rows_per_batch)
  if batch_major and pad.any:
    raise ValueError(f"rows_per_batch needs k={k} and n={n} to fit the "
                     f"tiles of {config}")
  if pad.any:
    x = jnp.pad(x.reshape(axis_size, m, k), ((0, 0), (0, pad.m), (0, pad.k)))
    x = x.reshape(axis_size * (m + pad.m), k + pad.k)
    w = jnp.pad(w, ((0, pad.k), (0, pad.n)))
  m_block, k_pad = m + pad.m, k + pad.k
  n_pad = w.shape[1]
  out_types = [jax.ShapeDtypeStruct((m_block, n_pad), out_dtype)]
  if axis_size > 1:
    # Receive buffer: slot s holds the partial sum for ring step s + 1.
    out_types.append(
        jax.ShapeDtypeStruct((axis_size - 1, m_block, n_pad), out_dtype))
  kernel = common.kernel_call(
      functools.partial(_ring_kernel, axis_name=axis_name,
                        axis_size=axis_size, config=config, m_block=m_block,
                        k=k_pad, n=n_pad, rows_per_batch=rows_per_batch,
                        diagnostic_loopback=_diagnostic_loopback),
      out_types)
  out = kernel(x, w)[0]
  return out[:m, :n] if (pad.m or pad.n) else out
