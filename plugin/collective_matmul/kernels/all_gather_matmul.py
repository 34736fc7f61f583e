"""All-gather-LHS matmul for Hopper in Pallas Mosaic GPU.

`all_gather(lhs) @ rhs` over a mesh axis of D devices joined by NVLink, run
inside `shard_map`. A ring: at step s device d multiplies shard (d + s) % D
by its rhs columns while forwarding that shard to device d - 1, straight
from the shared memory the matmul pipeline loaded it into (TMA copies to the
peer's scratch buffer), with a semaphore per (step, row block) announcing
arrival. Compared with the seed's design:

* one persistent loop over the tiles of all D steps: no barrier of all
  threads, no wait for every SM's signal and no tail wave between steps;
  a tile waits only for its own row block;
* a row block is forwarded by all its n-tiles, each sending a slice of k
  first in its pipeline (`spread_sends`), and each sender signals as soon as
  its slice has landed, so the next step's data arrives early.

Only plain peer-to-peer TMA stores cross NVLink (no NVLS multicast).
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
from collective_matmul.kernels.configs import AllGatherConfig


def _ring_kernel(lhs_local_ref, rhs_ref, out_ref, *maybe_scratch, axis_name,
                 axis_size, config: AllGatherConfig, m_shard, k, n,
                 rows_per_batch, diagnostic_loopback):
  scratch_ref = maybe_scratch[0] if maybe_scratch else None
  dtype = lhs_local_ref.dtype
  out_dtype = out_ref.dtype
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  cta_tile_m, cta_tile_n = config.cta_tile_m, config.cta_tile_n
  m_iters, n_iters, k_iters = m_shard // cta_tile_m, n // cta_tile_n, k // tile_k
  per_sender, num_senders, send_gap = schedule.send_plan(
      k_iters, n_iters, config.spread_sends, config.send_gap)
  epi_m, epi_n = config.epi_tile_m, config.epi_tile_n
  out_transforms = common.swizzled(out_dtype, epi_n)
  split_m = config.wg_dimension == "m"
  ring = axis_size > 1

  wg_idx = lax.axis_index("wg")
  if ring:
    dev, send_to = common.ring_neighbours(axis_name, axis_size)
    if diagnostic_loopback:  # Diagnostics only: wrong results.
      send_to = dev
    peer_scratch = plgpu.remote_ref(scratch_ref, common.peer_id(axis_name,
                                                                send_to))
    # arrived[s, i]: senders whose slice of row block i for step s + 1 landed.
    arrived = pl.get_global(
        plgpu.SemaphoreType.REGULAR((axis_size - 1, m_iters)))
  else:
    dev = 0

  def make_pipeline(body, compute_context, n_idx):
    return common.matmul_pipeline(
        body, compute_context, cta_tile_m=cta_tile_m, cta_tile_n=cta_tile_n,
        tile_k=tile_k, k_iters=k_iters, dtype=dtype,
        max_concurrent_steps=config.max_concurrent_steps,
        k_order=lambda kk: schedule.k_block(kk, n_idx, k_iters, per_sender,
                                            send_gap))

  ignore = lambda *_, **__: None
  allocs = make_pipeline(ignore, ignore, jnp.int32(0)).get_allocations(
      lhs_local_ref.at[pl.ds(0, cta_tile_m), :],
      rhs_ref.at[:, pl.ds(0, cta_tile_n)])

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=allocs,
      out_smem=plgpu.SMEM((2, 2, epi_m, epi_n), out_dtype,
                          transforms=out_transforms),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem):
    @plgpu.nd_loop((axis_size * m_iters * n_iters,),
                   collective_axes="cluster_grid")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      (linear,) = loop_info.index
      step, in_step = schedule.tile_coordinates(linear, m_iters, n_iters)
      m_idx, n_idx = plgpu.planar_snake(
          in_step, (m_iters, n_iters), 0 if config.grid_minor_dim == "m" else 1,
          config.grid_tile_width)
      source = schedule.source_device(dev, step, axis_size)
      out_rows = pl.ds(
          schedule.output_row(m_idx * cta_tile_m, source, axis_size,
                            rows_per_batch), cta_tile_m)
      cta_n = pl.ds(n_idx * cta_tile_n, cta_tile_n)
      wg_m = pl.ds(wg_idx * tile_m, tile_m) if split_m else slice(None)
      wg_n = slice(None) if split_m else pl.ds(wg_idx * tile_n, tile_n)
      if ring:
        share = schedule.sender_share(n_idx, k_iters, per_sender)
        forwards = (step < axis_size - 1) & (share > 0)
        last_send = schedule.last_send_step(n_idx, k_iters, per_sender,
                                            send_gap)
        # Announce once the last slice has had `send_gap` steps to land.
        signal_at = jnp.minimum(last_send + send_gap, k_iters - 1)

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped,
                           acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          eval_pipeline(acc_ref)
          acc = acc_ref[...].astype(out_dtype)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for mi in range(tile_m // epi_m):
            for ni in range(tile_n // epi_n):
              i = mi * (tile_n // epi_n) + ni
              slot = i % 2
              if i >= 2:  # Slot i % 2 held tile i - 2: that store read it.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
              out_smem[wg_idx, slot] = acc[mi * epi_m:(mi + 1) * epi_m,
                                           ni * epi_n:(ni + 1) * epi_n]
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(
                  out_smem.at[wg_idx, slot],
                  out_ref.at[out_rows, cta_n].at[wg_m, wg_n]
                  .at[pl.ds(mi * epi_m, epi_m), pl.ds(ni * epi_n, epi_n)])

      def mma_body(idxs, a_smem, b_smem, acc_ref):
        plgpu.wgmma(acc_ref, a_smem.at[wg_m], b_smem.at[:, wg_n])
        if ring:
          (kk,) = idxs
          k_block = schedule.k_block(kk, n_idx, k_iters, per_sender,
                                     send_gap)
          sender = forwards & (wg_idx == 0)
          sends_now = schedule.is_send_step(kk, n_idx, k_iters, per_sender,
                                            send_gap)
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
                peer_scratch.at[step, pl.ds(m_idx * cta_tile_m, cta_tile_m),
                                pl.ds(k_block * tile_k, tile_k)])

          @pl.when(sender & (kk == signal_at))
          def _announce():
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)
            pl.semaphore_signal(arrived.at[step, m_idx],
                                device_id=common.peer_id(axis_name, send_to))
        plgpu.wgmma_wait(1)
        return acc_ref

      def run_tile(a_ref):
        make_pipeline(mma_body, compute_context, n_idx)(
            a_ref.at[pl.ds(m_idx * cta_tile_m, cta_tile_m), :],
            rhs_ref.at[:, cta_n],
            allocations=pipeline_allocs)

      if not ring:
        run_tile(lhs_local_ref)
        return

      @pl.when(step == 0)
      def _local():
        run_tile(lhs_local_ref)

      @pl.when(step > 0)
      def _received():
        pl.semaphore_wait(arrived.at[step - 1, m_idx], num_senders,
                          decrement=False)
        run_tile(scratch_ref.at[step - 1])

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def all_gather_lhs_matmul(lhs, rhs, axis_name, *, config: AllGatherConfig,
                          out_dtype=None, rows_per_batch: int | None = None,
                          return_gathered: bool = False,
                          _diagnostic_loopback: bool = False):
  """`all_gather(lhs, axis_name, tiled=True) @ rhs` on Hopper GPUs.

  Call inside `shard_map` over `axis_name`. Shapes that do not fit the tiles
  are zero-padded (rows, k, columns) and the padding sliced off.

  Args:
    lhs: local rows `[m, k]`, bf16 or f16.
    rhs: local columns `[k, n]`, same dtype.
    axis_name: mesh axis of the ring (its devices must be NVLink peers).
    config: tiling and send pacing (`selection.select_config` picks one
      for a shape).
    out_dtype: result dtype: lhs's (default) or float32.
    rows_per_batch: when lhs is `[b, s, k]` gathered on `s` and flattened to
      `[b * s, k]`, pass `s`: the result is then written directly in the
      `[b, D * s, n]` order (flattened), with no transposes. Needs `s` to be
      a multiple of the CTA tile rows (see `supports_rows_per_batch`).

    return_gathered: also return `all_gather(lhs)` `[D, m, k]` (blocks in
      axis-index order), assembled from the shards the ring delivered, so a
      backward pass need not gather again.
    _diagnostic_loopback: diagnostics only, WRONG RESULTS for D > 1: every
      device forwards to its own scratch instead of its neighbour's, so the
      kernel does the same work without NVLink traffic (to time what the
      link costs, `"loopback": true` in
      `scripts/bench_kernels.py`'s config JSON).

  Returns:
    `[D * m, n]`: device blocks in axis-index order, or with `rows_per_batch`
    the flattened `[b, D * s, n]`; with `return_gathered` a pair.
  """
  out_dtype = common.check_operands(lhs, rhs, out_dtype)
  m, k = lhs.shape
  n = rhs.shape[1]
  axis_size = lax.axis_size(axis_name)
  common.check_config(config, AllGatherConfig)
  pad, rows_per_batch = common.tile_plan(config, m, k, n, lhs.dtype,
                                         out_dtype, rows_per_batch)
  if pad.any:
    lhs = jnp.pad(lhs, ((0, pad.m), (0, pad.k)))
    rhs = jnp.pad(rhs, ((0, pad.k), (0, pad.n)))
  m_shard, k_pad = lhs.shape
  n_pad = rhs.shape[1]
  out_types = [jax.ShapeDtypeStruct((axis_size * m_shard, n_pad), out_dtype)]
  if axis_size > 1:
    # Receive buffer: slot s holds the shard used at ring step s + 1.
    out_types.append(
        jax.ShapeDtypeStruct((axis_size - 1, m_shard, k_pad), lhs.dtype))
  kernel = common.kernel_call(
      functools.partial(_ring_kernel, axis_name=axis_name,
                        axis_size=axis_size, config=config, m_shard=m_shard,
                        k=k_pad, n=n_pad, rows_per_batch=rows_per_batch,
                        diagnostic_loopback=_diagnostic_loopback),
      out_types)
  results = kernel(lhs, rhs)
  out = results[0]
  if pad.m or pad.n:
    out = out.reshape(axis_size, m_shard, n_pad)[:, :m, :n]
    out = out.reshape(axis_size * m, n)
  if not return_gathered:
    return out
  # Slot s of the scratch holds shard (d + s + 1) % D: rotate into order.
  held = lhs[None] if axis_size == 1 else jnp.concatenate(
      [lhs[None], results[1]], axis=0)
  if axis_size > 1:
    held = jnp.roll(held, lax.axis_index(axis_name), axis=0)
  return out, held[:, :m, :k]
