"""Pieces both Hopper kernels share: device facts, layouts, the pipeline,
and the skeleton they run (`ring_tile_loop`), whose hooks each collective
fills."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from collective_matmul.kernels import configs
from collective_matmul.kernels import schedule


def num_sms() -> int:
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None and getattr(device, "num_cores", None):
    return device.num_cores
  # Off GPU (tracing the kernel on CPU in tests) an H100/H200's count.
  return getattr(jax.devices()[0], "core_count", None) or 132


def peer_id(axis_name, index):
  """Device id of `index` along `axis_name`, other mesh coordinates kept."""
  mesh = jax.sharding.get_abstract_mesh()
  if len(getattr(mesh, "axis_names", ())) > 1:
    return {axis_name: index}
  return index


def swizzled(dtype, cols: int):
  """Shared-memory transforms for tiles `cols` elements wide."""
  swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def matmul_pipeline(body, compute_context, *, cta_tile_m, cta_tile_n, tile_k,
                    k_iters, dtype, max_concurrent_steps, k_order=None,
                    delay_release=1, before_load=None, chained=False,
                    first_step=None):
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
  same way). Until run 49 the body left one step's wgmmas in flight with
  `delay_release=0` too: a race that went unseen at 128 x 128 warpgroup
  tiles and gave wrong results at 64 x 256.
  """
  order = k_order or (lambda kk: kk)
  if chained and k_iters % max_concurrent_steps:
    if first_step is None:
      raise ValueError("a chained pipeline whose steps are no multiple of "
                       "its depth needs first_step")
    return _OffsetChain(
        body, compute_context, cta_tile_m=cta_tile_m, cta_tile_n=cta_tile_n,
        tile_k=tile_k, k_iters=k_iters, dtype=dtype,
        stages=max_concurrent_steps, order=order, before_load=before_load,
        first_step=first_step)

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
  return plgpu.emit_pipeline_warp_specialized(
      waited_body,
      grid=(k_iters,),
      memory_registers=40,
      in_specs=[
          plgpu.BlockSpec((cta_tile_m, tile_k), a_block,
                          transforms=transforms, memory_space=plgpu.SMEM,
                          delay_release=delay_release),
          plgpu.BlockSpec((tile_k, cta_tile_n), lambda kk: (order(kk), 0),
                          transforms=transforms, memory_space=plgpu.SMEM,
                          delay_release=delay_release),
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
  for both."""

  def __init__(self, body, compute_context, *, cta_tile_m, cta_tile_n, tile_k,
               k_iters, dtype, stages, order, before_load, first_step):
    self.body, self.compute_context = body, compute_context
    self.cta_tile_m, self.cta_tile_n, self.tile_k = (cta_tile_m, cta_tile_n,
                                                     tile_k)
    self.k_iters, self.stages, self.order = k_iters, stages, order
    self.before_load, self.first_step = before_load, first_step
    self.transforms = swizzled(dtype, tile_k)

  def get_allocations(self, a_ref, b_ref):
    return dict(
        flat_in_smem_refs=[
            plgpu.SMEM((self.stages, self.cta_tile_m, self.tile_k),
                       a_ref.dtype, transforms=self.transforms),
            plgpu.SMEM((self.stages, self.tile_k, self.cta_tile_n),
                       b_ref.dtype, transforms=self.transforms)],
        flat_out_smem_refs=[],
        flat_produced_barrier_refs=[
            plgpu.Barrier(num_arrivals=2, num_barriers=self.stages)],
        flat_consumed_barrier_refs=[
            plgpu.Barrier(num_arrivals=2, num_barriers=self.stages)])

  def __call__(self, a_ref, b_ref, *, allocations):
    a_smem, b_smem = allocations["flat_in_smem_refs"]
    [produced] = allocations["flat_produced_barrier_refs"]
    [consumed] = allocations["flat_consumed_barrier_refs"]
    tile_k = self.tile_k

    def slot(kk):
      return lax.rem(self.first_step + kk, self.stages)

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
                                a_smem.at[s], produced.at[s])
        plgpu.copy_gmem_to_smem(b_ref.at[cols, pl.ds(0, self.cta_tile_n)],
                                b_smem.at[s], produced.at[s])

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

      def run(carry):
        def step(kk, carry):
          s = slot(kk)
          plgpu.barrier_wait(produced.at[s])
          carry = self.body((kk,), a_smem.at[s], b_smem.at[s], carry)
          # This step's wgmmas have read the slot: free it. (Keeping them
          # in flight and freeing each slot a step later costs a stage of
          # prefetch: 1.10-1.15 x cuBLAS at 3 stages, run 49.)
          plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(consumed.at[s])
          # As JAX's pipeline does after every step (the bodies' sends
          # count TMA store groups the same way under both).
          plgpu.commit_smem_to_gmem_group()
          return carry
        return lax.fori_loop(0, self.k_iters, step, carry)

      self.compute_context(run)


def can_chain(config, k_iters: int, delay_release: int) -> bool:
  """Whether a tile's pipeline may start loading while the previous tile's
  finishes (`matmul_pipeline(chained=True)`)."""
  del k_iters  # Any: `_OffsetChain` where JAX's pipeline cannot.
  return config.chain_tiles and delay_release == 0


def chain_slots_free(pipeline_allocs, wg_idx, max_concurrent_steps):
  """Before the first of chained pipelines: the compute warpgroups free
  every slot once, as a previous pipeline's last steps would have (its
  memory warpgroup then loads the first steps as a prologue would)."""
  # The one consumed barrier of JAX's automatic barrier management.
  [consumed] = pipeline_allocs["flat_consumed_barrier_refs"]

  @pl.when(wg_idx < 2)
  def _free():
    for slot in range(max_concurrent_steps):
      plgpu.barrier_arrive(consumed.at[slot])


# ------------------------------------------------ warpgroup traces (diagnostics)


class _Trace(NamedTuple):
  dump_dir: str
  ranges: int


_TRACE: contextvars.ContextVar[_Trace | None] = contextvars.ContextVar(
    "collective_matmul_trace", default=None)
# Shared memory of one traced range: 2 events of 2 words, per warpgroup.
TRACE_BYTES_PER_RANGE = 3 * 2 * 2 * 4


@contextlib.contextmanager
def trace_warpgroups(dump_dir: str, ranges_per_warpgroup: int = 64):
  """Diagnostics: kernels traced (jitted) inside this context record, on
  every block and warpgroup, when each of the skeleton's phases (`PHASES`)
  begins and ends, with Mosaic GPU's on-device profiler, and their calls
  write Chrome traces (`*-trace.json`) into `dump_dir`: JAX 0.12 one per
  call; JAX 0.11 one per kernel name, not overwritten, so only the first
  call's (of the first device) is kept. Times in the trace are SM clock
  cycles from the block's first event (`ts` in "us" is the block's global
  start time in ns plus those cycles, over 1000);
  scripts/warpgroup_trace.py reads them.

  A range costs `TRACE_BYTES_PER_RANGE` bytes of shared memory, counted in
  the kernels' shared-memory check. A warpgroup that records more ranges
  than `ranges_per_warpgroup` writes past its buffer into shared memory
  next to it, so size it for the most tiles a block runs (the benchmark
  scripts take 2-3 per tile, plus 4). Re-jit to trace: a function traced
  outside the context stays untraced.
  """
  if ranges_per_warpgroup < 1:
    raise ValueError(f"{ranges_per_warpgroup=} must be >= 1")
  token = _TRACE.set(_Trace(str(dump_dir), int(ranges_per_warpgroup)))
  try:
    yield
  finally:
    _TRACE.reset(token)


def trace_smem_bytes() -> int:
  """Shared memory the active `trace_warpgroups` adds per block (0 off)."""
  trace = _TRACE.get()
  return trace.ranges * TRACE_BYTES_PER_RANGE if trace else 0


# The phases a traced kernel records: a tile's k loop and epilogue on each
# compute warpgroup, and the collectives' waits.
PHASES = ("mma", "epilogue", "wait_arrival", "wait_partial_sum")


def phase(name: str):
  """A traced phase (`with phase("mma"): ...`): a `jax.named_scope`, which
  Mosaic GPU's profiler records as a range; costs nothing untraced."""
  if name not in PHASES:
    raise ValueError(f"phase {name!r} is not one of {PHASES}")
  return jax.named_scope(name)


def kernel_call(body, out_types):
  """A persistent kernel: one block per SM, 3 warpgroups (traced under
  `trace_warpgroups`)."""
  params = dict(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  trace = _TRACE.get()
  if trace is not None:
    params.update(profile_space=trace.ranges, profile_dir=trace.dump_dir)
  return plgpu.kernel(
      body,
      out_type=out_types,
      grid=(num_sms(),),
      grid_names=("cluster_grid",),
      cluster=(1,),
      cluster_names=("cluster",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(**params),
  )


def check_operands(lhs, rhs, out_dtype, names=("lhs", "rhs")):
  """Validates a kernel's 2-D operands; returns the result dtype."""
  a, b = names
  if lhs.ndim != 2 or rhs.ndim != 2:
    raise ValueError(f"expected 2-D {a} and {b}, got {lhs.shape}, {rhs.shape}")
  if lhs.shape[1] != rhs.shape[0]:
    raise ValueError(f"contraction sizes differ: {a} k={lhs.shape[1]}, "
                     f"{b} k={rhs.shape[0]}")
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"dtypes differ: {a} {lhs.dtype}, {b} {rhs.dtype}")
  if jnp.dtype(lhs.dtype).name not in configs.KERNEL_DTYPES:
    raise ValueError(f"dtype {lhs.dtype} is not supported (bf16 or f16)")
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  if out_dtype not in (jnp.dtype(lhs.dtype), jnp.dtype(jnp.float32)):
    raise ValueError(f"out_dtype {out_dtype} must be {lhs.dtype} or float32")
  return out_dtype


def check_config(config, config_class):
  """Checks that a kernel got its own config class."""
  if not isinstance(config, config_class):
    raise TypeError(f"config={config!r} must be a {config_class.__name__} "
                    "(`collective_matmul.selection` picks one for a shape)")


def check_shared_memory(config, dtype, out_dtype):
  smem = config.smem_bytes(jnp.dtype(dtype).itemsize,
                           jnp.dtype(out_dtype).itemsize)
  traced = trace_smem_bytes()
  if smem + traced > configs.SMEM_BYTES:
    extra = f" plus {traced} for `trace_warpgroups`" if traced else ""
    raise ValueError(f"{config} needs {smem} bytes of shared memory{extra}, "
                     f"more than the {configs.SMEM_BYTES} a Hopper block has")


def tile_plan(config, m, k, n, dtype, out_dtype, rows_per_batch):
  """Checks `config` for local sizes m x k x n; returns (padding, row run).

  The row run is `rows_per_batch` when it asks for the batch-major layout
  (validated against the tiles), else the padded m: one run of rows.
  """
  check_shared_memory(config, dtype, out_dtype)
  pad = schedule.padding(config, m, k, n)
  if rows_per_batch is None or rows_per_batch == m:
    return pad, m + pad.m
  if not schedule.supports_rows_per_batch(config, m, rows_per_batch):
    raise ValueError(
        f"rows_per_batch={rows_per_batch} must divide m={m} and be a "
        f"multiple of the CTA tile rows {config.cta_tile_m}")
  return pad, rows_per_batch


def ring_neighbours(axis_name, axis_size):
  """(this device's index, the index it sends to) on the ring d -> d - 1."""
  dev = lax.axis_index(axis_name)
  return dev, lax.rem(dev + axis_size - 1, axis_size)


# ------------------------------------------- the skeleton both kernels run


@dataclasses.dataclass(frozen=True)
class TileGrid:
  """The output tiles of all D ring steps, and this warpgroup's index.

  Built by `tile_grid` first thing in a kernel (it reads the warpgroup
  index), so the collective's own setup and hooks can use it.
  """

  config: configs.TileConfig
  axis_size: int
  m_iters: int
  n_iters: int
  k_iters: int
  wg_idx: jax.Array

  @property
  def epi_tiles(self) -> list[tuple[int, int]]:
    """(row, column) of each epilogue tile of a warpgroup tile, in store
    order."""
    c = self.config
    return [(mi, ni) for mi in range(c.tile_m // c.epi_tile_m)
            for ni in range(c.tile_n // c.epi_tile_n)]

  def epi_slice(self, i):
    """Epilogue tile i's rows and columns within a warpgroup tile."""
    mi, ni = self.epi_tiles[i]
    c = self.config
    return (pl.ds(mi * c.epi_tile_m, c.epi_tile_m),
            pl.ds(ni * c.epi_tile_n, c.epi_tile_n))

  def epi_part(self, acc, i):
    """Epilogue tile i of the warpgroup's accumulator value `acc`."""
    mi, ni = self.epi_tiles[i]
    c = self.config
    return acc[mi * c.epi_tile_m:(mi + 1) * c.epi_tile_m,
               ni * c.epi_tile_n:(ni + 1) * c.epi_tile_n]

  def coordinates(self, linear):
    """Linear tile index -> (ring step, m tile, n tile): steps outermost,
    a planar snake within a step."""
    c = self.config
    step, in_step = schedule.tile_coordinates(linear, self.m_iters,
                                              self.n_iters)
    m_idx, n_idx = plgpu.planar_snake(
        in_step, (self.m_iters, self.n_iters),
        0 if c.grid_minor_dim == "m" else 1, c.grid_tile_width)
    return step, m_idx, n_idx


def tile_grid(config, axis_size, m, k, n) -> TileGrid:
  """The tiles of a ring kernel on local sizes m x k x n (padded to fit)."""
  return TileGrid(config=config, axis_size=axis_size,
                  m_iters=m // config.cta_tile_m,
                  n_iters=n // config.cta_tile_n, k_iters=k // config.tile_k,
                  wg_idx=lax.axis_index("wg"))


class Received(NamedTuple):
  """A value loaded into the epilogue slots, that the accumulator is added
  to: `load(i)` starts loading epilogue tile i into slot i % 2, `wait(i)`
  waits until it is there."""

  load: Callable[[int], None]
  wait: Callable[[int], None]


@dataclasses.dataclass(frozen=True)
class Tile:
  """One output tile of one ring step, as the skeleton hands it to hooks.

  Attributes:
    step, m_idx, n_idx: the tile (`TileGrid.coordinates`).
    block: the ring's row block the tile works on (the collective's
      `row_block` hook says what that means).
    out_rows, cta_n: the tile's rows and columns of the output.
    wg_m, wg_n: this warpgroup's part of the CTA tile.
    loop_info: the persistent loop's step.
    scratch: the collective's shared-memory scratch (`ring_tile_loop`'s
      `scratch`).
  """

  grid: TileGrid
  step: jax.Array
  m_idx: jax.Array
  n_idx: jax.Array
  block: Any
  out_rows: Any
  cta_n: Any
  wg_m: Any
  wg_n: Any
  loop_info: plgpu.NDLoopInfo
  out_ref: Any
  out_smem: Any
  scratch: dict[str, Any]

  def slot(self, i):
    """The epilogue slot epilogue tile i goes through (i % 2)."""
    return self.out_smem.at[self.grid.wg_idx, i % 2]

  def to_output(self, src, epi):
    """Stores `src` as the part `epi` of this warpgroup's output tile."""
    plgpu.copy_smem_to_gmem(
        src, self.out_ref.at[self.out_rows, self.cta_n]
        .at[self.wg_m, self.wg_n].at[epi])

  def store_accumulator(self, acc, store, received: Received | None = None):
    """Stores the warpgroup's tile `acc` (out dtype) through its two epilogue
    slots: tile i is written to slot i % 2 (with `received`, added to what
    was loaded there), then `store(slot, epi_slice)` copies it out."""
    grid, wg_idx = self.grid, self.grid.wg_idx
    num_epi = len(grid.epi_tiles)
    for i in range(num_epi):
      slot = i % 2
      if received is not None:
        received.wait(i)
        self.out_smem[wg_idx, slot] += grid.epi_part(acc, i)
      else:
        if i >= 2:  # Slot i % 2 held tile i - 2: that store read it.
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        self.out_smem[wg_idx, slot] = grid.epi_part(acc, i)
      plgpu.commit_smem()
      store(self.out_smem.at[wg_idx, slot], grid.epi_slice(i))
      if received is not None and i + 2 < num_epi:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        received.load(i + 2)

  def store_to_output(self, acc_ref):
    """The plain epilogue: the accumulator, cast, into the output."""
    acc = acc_ref[...].astype(self.out_ref.dtype)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    self.store_accumulator(acc, self.to_output)


@dataclasses.dataclass(frozen=True)
class TileHooks:
  """What a collective does for one tile (`ring_tile_loop`'s `begin_tile`).

  Attributes:
    run: `run(matmul)` runs the tile's k loop by calling `matmul(a_ref,
      row)` (rows [row, row + cta_tile_m) of `a_ref` times the tile's
      columns of B), after whatever the collective waits for; it may call
      it in several branches.
    k_step: `k_step(kk, a_smem)` in the pipeline body, after the wgmma of
      step kk is issued and before waiting for the previous one (sends).
    epilogue: `epilogue(acc_ref)` after the k loop; default
      `Tile.store_to_output`.
    before_load: `before_load(kk)` in the memory warpgroup before it loads
      pipeline step kk's blocks (`matmul_pipeline`).
  """

  run: Callable[[Callable[[Any, Any], None]], None]
  k_step: Callable[[jax.Array, Any], None] | None = None
  epilogue: Callable[[Any], None] | None = None
  before_load: Callable[[jax.Array], None] | None = None


def persistent_loop(total: int, num_blocks: int):
  """`plgpu.nd_loop` over `total` tiles, interleaved over the first
  `num_blocks` blocks of the grid only (a block at or past `num_blocks`
  runs no iteration)."""
  block = lax.axis_index("cluster_grid")
  blocks = jnp.int32(num_blocks)
  upper = jnp.where(
      block < blocks,
      lax.div(jnp.int32(total), blocks) + (
          block < lax.rem(jnp.int32(total), blocks)).astype(jnp.int32),
      jnp.int32(0))

  def decorator(body):
    def wrapper(local, carry):
      body(plgpu.NDLoopInfo(index=(local * blocks + block,),
                            local_index=local, num_local_steps=upper))
      return carry

    lax.fori_loop(0, upper, wrapper, None)
  return decorator


def ring_tile_loop(grid: TileGrid, a_ref, b_ref, out_ref, *, row_block,
                   begin_tile, delay_release, k_order=None, scratch=None,
                   num_blocks: int | None = None):
  """The body both ring kernels run: one persistent loop over the tiles of
  all D ring steps, each tile a warp-specialized pipeline (allocated once)
  accumulating into f32 registers, then an epilogue through two
  shared-memory slots per warpgroup. The collective fills hooks:

  Args:
    grid: `tile_grid(...)`.
    a_ref, b_ref, out_ref: A (rows chosen per tile by the hooks), B (whose
      CTA-tile columns every tile multiplies) and the output.
    row_block: `row_block(step, m_idx) -> (block, out_rows)`: the ring's
      row block a tile works on and the output rows it writes.
    begin_tile: `begin_tile(tile: Tile) -> TileHooks`, the collective's
      work for one tile.
    delay_release, k_order: the pipeline's (`matmul_pipeline`); here
      `k_order(kk, n_idx)`.
    scratch: further shared-memory allocations, `{name: allocation}`
      (reach them through `Tile.scratch`).
    num_blocks: run the tiles on the first `num_blocks` blocks only (the
      others are the collective's, e.g. dedicated senders); default all.
  """
  config = grid.config
  dtype, out_dtype = a_ref.dtype, out_ref.dtype
  cta_tile_m, cta_tile_n = config.cta_tile_m, config.cta_tile_n
  split_m = config.wg_dimension == "m"
  wg_idx = grid.wg_idx

  chained = can_chain(config, grid.k_iters, delay_release)

  def make_pipeline(body, compute_context, n_idx, before_load=None,
                    first_step=0):
    order = None
    if k_order is not None:
      order = lambda kk: k_order(kk, n_idx)
    return matmul_pipeline(
        body, compute_context, cta_tile_m=cta_tile_m, cta_tile_n=cta_tile_n,
        tile_k=config.tile_k, k_iters=grid.k_iters, dtype=dtype,
        max_concurrent_steps=config.max_concurrent_steps, k_order=order,
        delay_release=delay_release, before_load=before_load,
        chained=chained, first_step=first_step)

  ignore = lambda *_, **__: None
  allocs = make_pipeline(
      ignore, ignore, None if k_order is None else jnp.int32(0)
  ).get_allocations(a_ref.at[pl.ds(0, cta_tile_m), :],
                    b_ref.at[:, pl.ds(0, cta_tile_n)])

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=allocs,
      out_smem=plgpu.SMEM((2, 2, config.epi_tile_m, config.epi_tile_n),
                          out_dtype,
                          transforms=swizzled(out_dtype, config.epi_tile_n)),
      **(scratch or {}),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem, **scratch_refs):
    if chained:
      chain_slots_free(pipeline_allocs, wg_idx, config.max_concurrent_steps)
    total = grid.axis_size * grid.m_iters * grid.n_iters
    loop = (plgpu.nd_loop((total,), collective_axes="cluster_grid")
            if num_blocks is None else persistent_loop(total, num_blocks))

    @loop
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      (linear,) = loop_info.index
      step, m_idx, n_idx = grid.coordinates(linear)
      block, out_rows = row_block(step, m_idx)
      cta_n = pl.ds(n_idx * cta_tile_n, cta_tile_n)
      wg_m = pl.ds(wg_idx * config.tile_m, config.tile_m) if split_m else (
          slice(None))
      wg_n = slice(None) if split_m else pl.ds(wg_idx * config.tile_n,
                                               config.tile_n)
      tile = Tile(grid=grid, step=step, m_idx=m_idx, n_idx=n_idx,
                  block=block, out_rows=out_rows, cta_n=cta_n, wg_m=wg_m,
                  wg_n=wg_n, loop_info=loop_info, out_ref=out_ref,
                  out_smem=out_smem, scratch=scratch_refs)
      hooks = begin_tile(tile)
      epilogue = hooks.epilogue or tile.store_to_output

      def compute_context(eval_pipeline):
        @functools.partial(
            pl.run_scoped,
            acc_ref=plgpu.ACC((config.tile_m, config.tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          with phase("mma"):
            eval_pipeline(acc_ref)
          with phase("epilogue"):
            epilogue(acc_ref)

      def mma_body(idxs, a_smem, b_smem, acc_ref):
        # The pipeline waits for the wgmma (`matmul_pipeline`).
        plgpu.wgmma(acc_ref, a_smem.at[wg_m], b_smem.at[:, wg_n])
        if hooks.k_step is not None:
          (kk,) = idxs
          hooks.k_step(kk, a_smem)
        return acc_ref

      def matmul(a_rows_ref, row):
        make_pipeline(mma_body, compute_context, n_idx, hooks.before_load,
                      loop_info.local_index * grid.k_iters)(
            a_rows_ref.at[pl.ds(row, cta_tile_m), :],
            b_ref.at[:, cta_n],
            allocations=pipeline_allocs)

      hooks.run(matmul)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
