"""The k loop both kernels run per output tile: a warp-specialized pipeline
(2 compute warpgroups issuing wgmmas, 1 memory warpgroup loading A's and
B's k blocks by TMA into shared-memory slots), optionally chained from tile
to tile on the same slots, and the shared-memory layout of its tiles."""
from __future__ import annotations

from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp


def swizzled(dtype, cols: int):
  """Shared-memory transforms for tiles `cols` elements wide."""
  swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def matmul_pipeline(body, compute_context, *, cta_tile_m, cta_tile_n, tile_k,
                    k_iters, dtype, max_concurrent_steps, k_order=None,
                    delay_release=1, before_load=None, chained=False,
                    first_step=None, weight_k_major=False, owner=None):
  """The warp-specialized k loop: 2 compute warpgroups, 1 memory warpgroup.

  `k_order(step)` gives the k block loaded at pipeline step `step`
  (default: in order). With `delay_release=1` slots are released one step
  late, so a body may still read its slot (e.g. to forward it) during the
  next; that costs one step of prefetch depth, so a kernel that does not
  forward passes 0. `before_load(step)` runs in the memory warpgroup just
  before it issues the loads of pipeline step `step` (e.g. to wait until
  that k block has arrived from a peer).

  `chained`: one of a sequence of pipelines on the same allocations (JAX's
  `PipelinePipeline.STEADY`): the memory warpgroup issues no prologue of
  its own, it loads each step as soon as the compute warpgroups freed its
  slot, possibly still in the previous pipeline, and does not wait for
  the last steps to be consumed. `chain_slots_free` must have freed every
  slot once before the first. Needs `delay_release=0`. JAX's pipeline
  chains only where `k_iters` is a multiple of `max_concurrent_steps`
  (every pipeline starts at slot 0); elsewhere `_OffsetChain` runs it,
  from slot `first_step % max_concurrent_steps`, `first_step` being the
  block's pipeline steps before this one (its tiles so far x `k_iters`).

  `body` issues its step's wgmmas and returns without waiting for them;
  the pipeline waits before a slot they read is freed. JAX's pipeline
  frees the step's slots (`delay_release=0`) or the previous step's (1)
  as the body returns, so the body is wrapped to wait until at most
  `delay_release` steps' wgmmas are in flight (`_OffsetChain` waits the
  same way). Leaving one step's wgmmas in flight with `delay_release=0`
  lets the next TMA load overwrite a slot a wgmma still reads
  (`tests/kernels` checks every wait against the release).

  `weight_k_major`: B is given K-major, `[n, k]` (its k blocks are
  `(cta_tile_n, tile_k)`, as 8-bit wgmma operands must be read); the body
  then multiplies by the slot transposed. False: `[k, n]`.

  `owner` (`TileConfig.pingpong`; a traced 0 or 1): only that compute
  warpgroup runs this tile, on the whole CTA tile, while the other runs
  its own previous or next one (`_OffsetChain` with `owner`). Needs
  `chained` and `first_step`. None: both run it.
  """
  order = k_order or (lambda kk: kk)
  if owner is not None and (not chained or first_step is None):
    raise ValueError("a ping-pong pipeline (owner) is chained, with "
                     "first_step")
  if chained and (k_iters % max_concurrent_steps or owner is not None):
    if first_step is None:
      raise ValueError("a chained pipeline whose steps are no multiple of "
                       "its depth needs first_step")
    return _OffsetChain(
        body, compute_context, cta_tile_m=cta_tile_m, cta_tile_n=cta_tile_n,
        tile_k=tile_k, k_iters=k_iters, dtype=dtype,
        stages=max_concurrent_steps, order=order, before_load=before_load,
        first_step=first_step, weight_k_major=weight_k_major, owner=owner)

  def waited_body(idxs, a_smem, b_smem, carry):
    carry = body(idxs, a_smem, b_smem, carry)
    plgpu.wgmma_wait(delay_release)
    return carry

  def a_block(kk):
    # JAX's pipeline evaluates an input's index map only where the memory
    # warpgroup issues that input's copy (A's first, then B's), so a wait
    # placed here holds exactly the loads of step kk. Also traced once,
    # unevaluated, to see which grid indices the map uses.
    if before_load is not None:
      before_load(kk)
    return 0, order(kk)

  transforms = swizzled(dtype, tile_k)
  if weight_k_major:
    b_spec = plgpu.BlockSpec((cta_tile_n, tile_k), lambda kk: (0, order(kk)),
                             transforms=transforms, memory_space=plgpu.SMEM,
                             delay_release=delay_release)
  else:
    b_spec = plgpu.BlockSpec((tile_k, cta_tile_n), lambda kk: (order(kk), 0),
                             transforms=transforms, memory_space=plgpu.SMEM,
                             delay_release=delay_release)
  return plgpu.emit_pipeline_warp_specialized(
      waited_body,
      grid=(k_iters,),
      memory_registers=40,
      in_specs=[
          plgpu.BlockSpec((cta_tile_m, tile_k), a_block,
                          transforms=transforms, memory_space=plgpu.SMEM,
                          delay_release=delay_release),
          b_spec,
      ],
      wg_axis="wg",
      num_compute_wgs=2,
      max_concurrent_steps=max_concurrent_steps,
      compute_context=compute_context,
      pipeline_state=plgpu.PipelinePipeline.STEADY if chained else None,
  )


# Registers per thread: the memory warpgroup's, and what that leaves each of
# the 2 compute warpgroups of the 64 K register file (as JAX's pipeline
# splits it: at most 255, rounded down to a multiple of 8).
MEMORY_REGISTERS = 40
COMPUTE_REGISTERS = int(min(256, (512 - MEMORY_REGISTERS) / 2) // 8 * 8)


class _OffsetChain:
  """A chained warp-specialized k loop whose slots continue from the
  previous tile's (`matmul_pipeline` with `chained=True` where `k_iters` is
  no multiple of the depth; JAX's pipeline restarts at slot 0 and so
  refuses those). Pipeline step kk uses slot (first_step + kk) % stages:
  the memory warpgroup waits until the compute warpgroups freed that slot
  (`consumed`, 2 arrivals), runs `before_load(kk)`, then TMA-loads A's and
  B's k block `order(kk)` into it (`produced`, one arrival per copy); the
  compute warpgroups wait for it, run `body((kk,), a, b, carry)` (which
  issues wgmmas), wait for its wgmmas and free the slot, as JAX's
  pipeline does with `delay_release=0`. Allocations have the layout of
  JAX's, so `chain_slots_free` and the skeleton's allocation are the same
  for both (with `weight_k_major` B's slots are `(cta_tile_n, tile_k)`).

  With `owner` (ping-pong): only compute warpgroup `owner` runs the tile
  (it frees each slot alone: `consumed` takes 1 arrival), and a load lands
  on the owner's own `produced` barrier of the slot (2 x `stages` of
  them). Each barrier's phase is tracked by the threads that wait on it,
  so a warpgroup must wait on every phase of a barrier it waits on: with
  one set shared, the warpgroup that skips the other's tiles would wait
  on a stale parity. The memory warpgroup waits on every `consumed`
  phase, whoever freed it; the slots are one ring, loaded in tile order,
  so the next tile's first steps load while this one's last run. The
  owner keeps one step's wgmmas in flight and frees each slot a step
  late."""

  def __init__(self, body, compute_context, *, cta_tile_m, cta_tile_n, tile_k,
               k_iters, dtype, stages, order, before_load, first_step,
               weight_k_major=False, owner=None):
    self.body, self.compute_context = body, compute_context
    self.cta_tile_m, self.cta_tile_n, self.tile_k = (cta_tile_m, cta_tile_n,
                                                     tile_k)
    self.k_iters, self.stages, self.order = k_iters, stages, order
    self.before_load, self.first_step = before_load, first_step
    self.transforms = swizzled(dtype, tile_k)
    self.weight_k_major = weight_k_major
    self.owner = owner

  def b_block_shape(self):
    return ((self.cta_tile_n, self.tile_k) if self.weight_k_major else
            (self.tile_k, self.cta_tile_n))

  def get_allocations(self, a_ref, b_ref):
    pingpong = self.owner is not None
    consumed = plgpu.Barrier(num_arrivals=1 if pingpong else 2,
                             num_barriers=self.stages)
    return dict(
        flat_in_smem_refs=[
            plgpu.SMEM((self.stages, self.cta_tile_m, self.tile_k),
                       a_ref.dtype, transforms=self.transforms),
            plgpu.SMEM((self.stages, *self.b_block_shape()),
                       b_ref.dtype, transforms=self.transforms)],
        flat_out_smem_refs=[],
        flat_produced_barrier_refs=[
            plgpu.Barrier(num_arrivals=2, num_barriers=self.stages
                          * (2 if pingpong else 1))],
        flat_consumed_barrier_refs=[consumed])

  def __call__(self, a_ref, b_ref, *, allocations):
    a_smem, b_smem = allocations["flat_in_smem_refs"]
    [produced] = allocations["flat_produced_barrier_refs"]
    [consumed] = allocations["flat_consumed_barrier_refs"]
    tile_k = self.tile_k

    def slot(kk):
      return lax.rem(self.first_step + kk, self.stages)

    def produced_at(s):
      """The barrier the load into slot s lands on: the owner's."""
      if self.owner is None:
        return produced.at[s]
      return produced.at[self.owner * self.stages + s]

    wg = lax.axis_index("wg")

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

      @pl.loop(0, self.k_iters)
      def _load(kk):
        s = slot(kk)
        plgpu.barrier_wait(consumed.at[s])
        if self.before_load is not None:
          self.before_load(kk)
        cols = pl.ds(self.order(kk) * tile_k, tile_k)
        plgpu.copy_gmem_to_smem(a_ref.at[pl.ds(0, self.cta_tile_m), cols],
                                a_smem.at[s], produced_at(s))
        b_block = (b_ref.at[pl.ds(0, self.cta_tile_n), cols]
                   if self.weight_k_major else
                   b_ref.at[cols, pl.ds(0, self.cta_tile_n)])
        plgpu.copy_gmem_to_smem(b_block, b_smem.at[s], produced_at(s))

    @pl.when(wg < 2 if self.owner is None else wg == self.owner)
    def _compute():
      plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

      def run(carry):
        def step(kk, carry):
          s = slot(kk)
          plgpu.barrier_wait(produced_at(s))
          carry = self.body((kk,), a_smem.at[s], b_smem.at[s], carry)
          if self.owner is None:
            # This step's wgmmas have read the slot: free it. (Keeping
            # them in flight and freeing each slot a step later would cost
            # a stage of prefetch.)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(consumed.at[s])
          else:
            # Ping-pong: this warpgroup is mostly alone on the tensor
            # cores (the other one is in its epilogue or waits for its
            # next tile), so draining every step would leave them idle
            # between steps: keep this step's wgmmas in flight and free
            # the previous step's slot (one stage less prefetch).
            plgpu.wgmma_wait(1)

            @pl.when(kk > 0)
            def _free_previous():
              plgpu.barrier_arrive(consumed.at[slot(kk - 1)])
          # As JAX's pipeline does after every step (the bodies' sends
          # count TMA store groups the same way under both).
          plgpu.commit_smem_to_gmem_group()
          return carry
        carry = lax.fori_loop(0, self.k_iters, step, carry)
        if self.owner is not None:
          plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(consumed.at[slot(self.k_iters - 1)])
        return carry

      self.compute_context(run)


def can_chain(config, k_iters: int, delay_release: int) -> bool:
  """Whether a tile's pipeline may start loading while the previous tile's
  finishes (`matmul_pipeline(chained=True)`)."""
  del k_iters  # Any: `_OffsetChain` where JAX's pipeline cannot.
  return config.chain_tiles and delay_release == 0


def chain_slots_free(pipeline_allocs, wg_idx, max_concurrent_steps,
                     pingpong=False):
  """Before the first of chained pipelines: the compute warpgroups free
  every slot once, as a previous pipeline's last steps would have (its
  memory warpgroup then loads the first steps as a prologue would). With
  `pingpong` a slot is freed by one warpgroup (`_OffsetChain`'s `owner`):
  warpgroup 0 frees them all."""
  # The one consumed barrier of JAX's automatic barrier management.
  [consumed] = pipeline_allocs["flat_consumed_barrier_refs"]

  @pl.when(wg_idx == 0 if pingpong else wg_idx < 2)
  def _free():
    for slot in range(max_concurrent_steps):
      plgpu.barrier_arrive(consumed.at[slot])

