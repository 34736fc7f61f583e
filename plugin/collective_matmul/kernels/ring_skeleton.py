"""The skeleton both ring kernels run (`ring_tile_loop`), whose hooks each
collective fills: the tile grid of all D ring steps, the persistent loop
over it, each tile's k loop (`pipeline`) and its epilogue stores; and the
persistent kernel's launch (`kernel_call`) with the checks of its operands
and config."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from collective_matmul.kernels import configs
from collective_matmul.kernels import peers
from collective_matmul.kernels import schedule
from collective_matmul.kernels import tracing
from collective_matmul.kernels.pipeline import can_chain
from collective_matmul.kernels.pipeline import chain_slots_free
from collective_matmul.kernels.pipeline import matmul_pipeline
from collective_matmul.kernels.pipeline import swizzled


def kernel_call(body, out_types, ring):
  """A persistent kernel: one block per SM, 3 warpgroups (traced under
  `tracing.trace_warpgroups`); with virtual ranks (`peers.VirtualRanks`)
  the blocks of their shares."""
  params = dict(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                **tracing.profiler_params())
  return plgpu.kernel(
      body,
      out_type=out_types,
      grid=(ring.launch_blocks(configs.sm_count()),),
      grid_names=(peers.GRID_AXIS,),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(**params),
  )


_JAX_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
# `plgpu.load(ref, idx, ...)` takes the index separately up to JAX 0.10
# (deprecated in 0.11, gone in 0.12: the ref is indexed with `.at`).
_LOAD_PARAMS = inspect.signature(plgpu.load).parameters
_LOAD_NEEDS_INDEX = ("idx" in _LOAD_PARAMS and
                     _LOAD_PARAMS["idx"].default is inspect.Parameter.empty)
# The layouts a kernel takes its weight in: "kn" (`[k, n]`) or "nk"
# (`[n, k]`, K-major).
WEIGHT_LAYOUTS = ("kn", "nk")


def weight_k_major(layout, name="weight") -> bool:
  """Whether a weight given in `layout` (`WEIGHT_LAYOUTS`) is K-major."""
  if layout not in WEIGHT_LAYOUTS:
    raise ValueError(f"{name}_layout={layout!r} must be 'kn' ([k, n]) or "
                     "'nk' ([n, k], K-major)")
  return layout == "nk"


def check_scale(scale):
  """The per-tensor scale of a product: an f32 scalar, or None."""
  if scale is None:
    return
  if (getattr(scale, "shape", None) != ()
      or getattr(scale, "dtype", None) != jnp.float32):
    raise ValueError(
        f"scale of shape {getattr(scale, 'shape', None)} and dtype "
        f"{getattr(scale, 'dtype', type(scale).__name__)}: expected a float32 "
        "scalar (shape ()), the product of the operands' scales")


def check_vector_scales(row_scale, col_scale, *, rows: int | None = None,
                        cols: int | None = None, out_dtype=None, lead=(),
                        row_meaning="row", col_meaning="column"):
  """The per-row and per-column scales of a product: None, or float32
  vectors of `rows` and `cols` entries (with virtual ranks `lead`, `(D,)`,
  in front: one vector per rank). Called first with the requested
  `out_dtype` alone (a scaled result must be floating point: before the
  operands' checks, so the message names the scale), then with the sizes
  once the operands are checked."""
  given = [(value, size, name, meaning) for value, size, name, meaning in (
      (row_scale, rows, "row_scale", row_meaning),
      (col_scale, cols, "col_scale", col_meaning)) if value is not None]
  for value, size, name, meaning in given:
    if out_dtype is not None and not jnp.issubdtype(out_dtype, jnp.floating):
      raise ValueError(f"{name} given with an integer result "
                       f"(out_dtype={jnp.dtype(out_dtype).name}): scales "
                       "multiply a floating-point accumulator")
    dtype = getattr(value, "dtype", None)
    if dtype != jnp.float32:
      raise ValueError(f"{name} of dtype "
                       f"{getattr(dtype, 'name', type(value).__name__)}: "
                       "expected float32")
    shape = getattr(value, "shape", None)
    if size is not None and shape != (*lead, size):
      raise ValueError(
          f"{name} of shape {shape}: expected {(*lead, size)}, one float32 "
          f"scale per {meaning}" + (" of each rank" if lead else ""))


def check_operands(lhs, rhs, out_dtype, names=("lhs", "rhs"), *,
                   k_major=False, tile_k=None):
  """Validates a kernel's 2-D operands (the weight `[n, k]` where
  `k_major`); returns the result dtype."""
  a, b = names
  if lhs.ndim != 2 or rhs.ndim != 2:
    raise ValueError(f"expected 2-D {a} and {b}, got {lhs.shape}, {rhs.shape}")
  rhs_k = rhs.shape[1] if k_major else rhs.shape[0]
  if lhs.shape[1] != rhs_k:
    raise ValueError(f"contraction sizes differ: {a} k={lhs.shape[1]}, "
                     f"{b} k={rhs_k}" + (" (given [n, k])" if k_major else ""))
  if configs.is_fp8(lhs.dtype) or configs.is_fp8(rhs.dtype):
    reason = configs.fp8_reason(lhs.dtype, rhs.dtype, out_dtype, k_major,
                                tile_k)
    if reason is not None:
      raise ValueError(f"{a} and {b}: {reason}")
    if lhs.dtype != rhs.dtype and _JAX_VERSION < (0, 11):
      raise ValueError(
          f"{a} and {b}: fp8 operands {lhs.dtype} x {rhs.dtype} need JAX >= "
          f"0.11 (the wgmma of JAX {jax.__version__} takes one dtype)")
    return jnp.dtype(out_dtype or jnp.bfloat16)
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"dtypes differ: {a} {lhs.dtype}, {b} {rhs.dtype}")
  reason = configs.dtype_reason(lhs.dtype, out_dtype)
  if reason is not None:
    raise ValueError(f"{a} and {b}: {reason}")
  return jnp.dtype(out_dtype or lhs.dtype)


def per_rank(x, ring):
  """`x` as one rank sees it: without the leading rank axis of virtual
  ranks' stacked arrays (`peers.VirtualRanks`)."""
  return jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if ring.stacked else x


def check_config(config, config_class):
  """Checks that a kernel got its own config class."""
  if not isinstance(config, config_class):
    raise TypeError(f"config={config!r} must be a {config_class.__name__} "
                    "(`collective_matmul.selection` picks one for a shape)")


def check_axis(config, axis_size):
  """Raises where `configs.axis_reason` refuses `config` on this axis."""
  reason = configs.axis_reason(config, axis_size)
  if reason:
    raise ValueError(reason)


def check_shared_memory(config, dtype, out_dtype):
  smem = config.smem_bytes(jnp.dtype(dtype).itemsize,
                           jnp.dtype(out_dtype).itemsize)
  traced = tracing.trace_smem_bytes()
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


def clips_columns(config, n, *n_minor_dtypes) -> bool:
  """Whether the last output columns, past a whole number of CTA tiles,
  are left to TMA instead of padded: its loads read zeros past column n
  and its stores drop what lies past it, so the operand is not padded and
  the output not sliced (two copies of XLA's around the kernel). The
  tiles still cover the padded width (`schedule.padding`). Mosaic GPU's
  TMA takes a global array whose minor dimension is a whole number of
  its shared-memory tiling (at most a 128-byte swizzle's width:
  `n_minor_dtypes`, those of the arrays whose rows run along n), and the
  pipeline's allocation takes one whole CTA tile of columns."""
  return n >= config.cta_tile_n and all(
      n % (_MAX_SWIZZLE_BYTES // jnp.dtype(dtype).itemsize) == 0
      for dtype in n_minor_dtypes)


# The widest shared-memory swizzle (`pipeline.swizzled`'s), in bytes.
_MAX_SWIZZLE_BYTES = 128


def ring_neighbours(ring):
  """(this rank, the rank it sends to) on the ring d -> d - 1."""
  dev = ring.rank()
  return dev, lax.rem(dev + ring.axis_size - 1, ring.axis_size)


@dataclasses.dataclass(frozen=True)
class ScaleOperands:
  """Which scales a kernel takes (static), each an operand after A and B in
  this order: the per-tensor scalar (`(1,)` f32), the row scales (f32, one
  per row of A as the collective numbers them: `Tile.scale_row`) and the
  column scales (f32, one per column of B, padded to the tiles)."""

  scalar: bool = False
  rows: bool = False
  cols: bool = False

  @classmethod
  def of(cls, scale, row_scale, col_scale) -> "ScaleOperands":
    return cls(scale is not None, row_scale is not None,
               col_scale is not None)

  def split(self, refs):
    """(`ScaleRefs`, the remaining refs) of the refs after A and B."""
    refs = list(refs)
    scalar, rows, cols = (refs.pop(0) if given else None
                          for given in (self.scalar, self.rows, self.cols))
    return ScaleRefs(scalar, rows, cols), refs


class ScaleRefs(NamedTuple):
  """The scale operands in global memory (`ScaleOperands`), or None each:
  `scalar` a `(1,)` f32, `rows` and `cols` this rank's f32 vectors."""

  scalar: Any = None
  rows: Any = None
  cols: Any = None


def scale_operands(scale, row_scale, col_scale, *, rows_pad=None,
                   cols_pad: int = 0, lead=()):
  """The kernel's scale operands in `ScaleOperands` order: the scalar as
  `(1,)`, the vectors' last axis zero-padded (rows `rows_pad(vector)`, which
  pads and flattens a row vector as its collective numbers rows; columns by
  `cols_pad`)."""
  keep = ((0, 0),) * len(lead)
  operands = []
  if scale is not None:
    operands.append(scale.reshape(1))
  if row_scale is not None:
    operands.append(rows_pad(row_scale))
  if col_scale is not None:
    operands.append(jnp.pad(col_scale, keep + ((0, cols_pad),))
                    if cols_pad else col_scale)
  return tuple(operands)


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
        in_step, (self.m_iters, self.n_iters), 0, c.grid_tile_width)
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
    scale: the f32 scalar the accumulator is multiplied by in the epilogue
      (`ring_tile_loop`'s `scales.scalar`, loaded once per block), or None.
    row_scales, col_scales: this rank's f32 row and column scale vectors in
      global memory (`ring_tile_loop`'s `scales`), or None.
    scale_row: where the CTA tile's rows start in `row_scales` (the
      collective's `scale_row` hook), where row scales are given.
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
  scale: Any = None
  row_scales: Any = None
  col_scales: Any = None
  scale_row: Any = None

  @property
  def owner(self):
    """With `pingpong`, the compute warpgroup that runs this whole tile
    (the block's tiles alternate between the two), else None (both run
    their halves)."""
    if not self.grid.config.pingpong:
      return None
    return lax.rem(self.loop_info.local_index, 2)

  @property
  def lead_wg(self):
    """The compute warpgroup that speaks for the tile to the peer (sends
    what the tile forwards, announces it): its owner, or warpgroup 0."""
    owner = self.owner
    return 0 if owner is None else owner

  @property
  def warpgroups(self) -> int:
    """Compute warpgroups that work on the tile: 1 with `pingpong`, else 2
    (each its half)."""
    return 1 if self.grid.config.pingpong else 2

  @property
  def stride(self) -> int:
    """How many of the block's tiles apart this warpgroup's consecutive
    tiles are: 2 with `pingpong` (they alternate), else 1."""
    return 2 if self.grid.config.pingpong else 1

  def accumulator(self, acc_ref):
    """The warpgroup's f32 accumulator, scaled (`scale`, then row i's
    `row_scales` entry and column j's `col_scales` entry), in the out
    dtype."""
    acc = acc_ref[...]
    if self.scale is not None:
      acc = acc * self.scale
    config = self.grid.config
    if self.row_scales is not None:
      first = self.scale_row + (self.grid.wg_idx * config.tile_m
                                if config.splits("m") else 0)
      acc = acc * _broadcast_scales(self.row_scales, first, acc.shape, 0)
    if self.col_scales is not None:
      first = self.n_idx * config.cta_tile_n + (
          self.grid.wg_idx * config.tile_n if config.splits("n") else 0)
      acc = acc * _broadcast_scales(self.col_scales, first, acc.shape, 1)
    return acc.astype(self.out_ref.dtype)

  def slot(self, i):
    """The epilogue slot epilogue tile i goes through (i % 2, or the one
    slot with `epi_slots=1`)."""
    return self.out_smem.at[self.grid.wg_idx, i % self.grid.config.epi_slots]

  def to_output(self, src, epi):
    """Stores `src` as the part `epi` of this warpgroup's output tile."""
    plgpu.copy_smem_to_gmem(
        src, self.out_ref.at[self.out_rows, self.cta_n]
        .at[self.wg_m, self.wg_n].at[epi])

  def store_accumulator(self, acc, store, received: Received | None = None):
    """Stores the warpgroup's tile `acc` (out dtype) through its two epilogue
    slots (one with `epi_slots=1`): tile i is written to slot i % 2 (with
    `received`, added to what was loaded there), then `store(slot,
    epi_slice)` copies it out."""
    grid, wg_idx = self.grid, self.grid.wg_idx
    num_epi = len(grid.epi_tiles)
    slots = grid.config.epi_slots  # 2, or 1 for a one-tile epilogue.
    for i in range(num_epi):
      slot = i % slots
      if received is not None:
        received.wait(i)
        self.out_smem[wg_idx, slot] += grid.epi_part(acc, i)
      else:
        if i >= slots:  # The slot held tile i - slots: its store read it.
          plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
        self.out_smem[wg_idx, slot] = grid.epi_part(acc, i)
      plgpu.commit_smem()
      store(self.out_smem.at[wg_idx, slot], grid.epi_slice(i))
      if received is not None and i + 2 < num_epi:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        received.load(i + 2)

  def store_to_output(self, acc_ref):
    """The plain epilogue: the accumulator, scaled and cast, into the
    output."""
    acc = self.accumulator(acc_ref)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    self.store_accumulator(acc, self.to_output)


def _broadcast_scales(vector_ref, first, shape, axis):
  """`vector_ref[first:first + shape[axis]]` broadcast to `shape` along the
  other axis, in the WGMMA accumulator's layout: loaded straight from
  global memory into the registers that hold those rows (`axis` 0) or
  columns (1) of the accumulator, no shared memory or barrier. Each
  thread loads the entries of its own rows or columns: 2 rows of every
  64 (`tile_m / 32` scales), 2 columns of every 8 (`tile_n / 4`).

  The load is a plain one (`optimized=False`: each thread loads its
  registers' vectors in the layout's order, with no transfer plan): JAX
  0.11's Mosaic GPU plans optimized transfers for shared memory only and
  refuses one from global memory ("Only optimized transfers to SMEM
  supported"); JAX 0.12 plans both."""
  layout = plgpu.Layout.WGMMA.reduce(1 - axis)
  window = pl.ds(first, shape[axis])
  if _LOAD_NEEDS_INDEX:  # JAX 0.10: the index is a separate argument.
    vector = plgpu.load(vector_ref, window, layout=layout, optimized=False)
  else:
    vector = plgpu.load(vector_ref.at[window], layout=layout,
                        optimized=False)
  return lax.broadcast_in_dim(vector, shape, (axis,))


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


def persistent_loop(total: int, num_blocks, block):
  """`plgpu.nd_loop` over `total` tiles, interleaved over the first
  `num_blocks` blocks (`block`: this one's index among them; a block at or
  past `num_blocks` runs no iteration)."""
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


def ring_tile_loop(grid: TileGrid, a_ref, b_ref, out_ref, *, ring, row_block,
                   begin_tile, delay_release, k_order=None, scratch=None,
                   num_blocks: int | None = None, weight_k_major: bool = False,
                   scales: ScaleRefs = ScaleRefs(), scale_row=None):
  """The body both ring kernels run: one persistent loop over the tiles of
  all D ring steps, each tile a warp-specialized pipeline (allocated once)
  accumulating into f32 registers, then an epilogue through two
  shared-memory slots per warpgroup. The collective fills hooks:

  Args:
    grid: `tile_grid(...)`.
    ring: the ranks' seam (`peers`): this rank's blocks.
    a_ref, b_ref, out_ref: A (rows chosen per tile by the hooks), B (whose
      CTA-tile columns every tile multiplies; `[k, n]`, or `[n, k]` with
      `weight_k_major`) and the output. The operands' dtypes are the wgmma's:
      bf16 or f16, or fp8 (K-major B, `configs.fp8_reason`).
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
    weight_k_major: B is `[n, k]`; its k blocks are multiplied transposed.
    scales: the scale operands (`ScaleRefs`; the vectors this rank's
      views) the epilogue multiplies every accumulator by
      (`Tile.accumulator`).
    scale_row: `scale_row(step, m_idx, block) -> row`: where a CTA tile's
      rows start in `scales.rows` (needed with row scales).
  """
  config = grid.config
  dtype, out_dtype = a_ref.dtype, out_ref.dtype
  cta_tile_m, cta_tile_n = config.cta_tile_m, config.cta_tile_n
  wg_idx = grid.wg_idx

  chained = can_chain(config, grid.k_iters, delay_release)
  if config.pingpong and not chained:
    raise ValueError(f"{config} (pingpong) needs a chained pipeline: slots "
                     "released at once (delay_release=0)")

  def make_pipeline(body, compute_context, n_idx, before_load=None,
                    first_step=0, owner=None):
    order = None
    if k_order is not None:
      order = lambda kk: k_order(kk, n_idx)
    return matmul_pipeline(
        body, compute_context, cta_tile_m=cta_tile_m, cta_tile_n=cta_tile_n,
        tile_k=config.tile_k, k_iters=grid.k_iters, dtype=dtype,
        max_concurrent_steps=config.max_concurrent_steps, k_order=order,
        delay_release=delay_release, before_load=before_load,
        chained=chained, first_step=first_step, weight_k_major=weight_k_major,
        owner=owner)

  def b_columns(cols):
    """B's k blocks of the output columns `cols`."""
    return b_ref.at[cols, :] if weight_k_major else b_ref.at[:, cols]

  ignore = lambda *_, **__: None
  allocs = make_pipeline(
      ignore, ignore, None if k_order is None else jnp.int32(0),
      owner=0 if config.pingpong else None
  ).get_allocations(a_ref.at[pl.ds(0, cta_tile_m), :],
                    b_columns(pl.ds(0, cta_tile_n)))

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=allocs,
      out_smem=plgpu.SMEM((2, config.epi_slots, config.epi_tile_m,
                           config.epi_tile_n),
                          out_dtype,
                          transforms=swizzled(out_dtype, config.epi_tile_n)),
      **(scratch or {}),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem, **scratch_refs):
    if chained:
      chain_slots_free(pipeline_allocs, wg_idx, config.max_concurrent_steps,
                       pingpong=config.pingpong)
    # Read once per block; every epilogue multiplies by it.
    scale = None if scales.scalar is None else scales.scalar[0]
    total = grid.axis_size * grid.m_iters * grid.n_iters
    if num_blocks is None and ring.whole_grid():
      loop = plgpu.nd_loop((total,), collective_axes=peers.GRID_AXIS)
    else:
      loop = persistent_loop(
          total, ring.blocks() if num_blocks is None else num_blocks,
          ring.block())

    @loop
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      (linear,) = loop_info.index
      step, m_idx, n_idx = grid.coordinates(linear)
      block, out_rows = row_block(step, m_idx)
      cta_n = pl.ds(n_idx * cta_tile_n, cta_tile_n)
      # This warpgroup's part of the CTA tile (with `pingpong` the whole
      # tile, on alternate tiles: `owner` below).
      wg_m = (pl.ds(wg_idx * config.tile_m, config.tile_m)
              if config.splits("m") else slice(None))
      wg_n = (pl.ds(wg_idx * config.tile_n, config.tile_n)
              if config.splits("n") else slice(None))
      tile = Tile(grid=grid, step=step, m_idx=m_idx, n_idx=n_idx,
                  block=block, out_rows=out_rows, cta_n=cta_n, wg_m=wg_m,
                  wg_n=wg_n, loop_info=loop_info, out_ref=out_ref,
                  out_smem=out_smem, scratch=scratch_refs, scale=scale,
                  row_scales=scales.rows, col_scales=scales.cols,
                  scale_row=(None if scales.rows is None else
                             scale_row(step, m_idx, block)))
      hooks = begin_tile(tile)
      epilogue = hooks.epilogue or tile.store_to_output

      def compute_context(eval_pipeline):
        @functools.partial(
            pl.run_scoped,
            acc_ref=plgpu.ACC((config.tile_m, config.tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          with tracing.phase("mma"):
            eval_pipeline(acc_ref)
          with tracing.phase("epilogue"):
            epilogue(acc_ref)

      def mma_body(idxs, a_smem, b_smem, acc_ref):
        # The pipeline waits for the wgmma (`matmul_pipeline`).
        if weight_k_major:
          plgpu.wgmma(acc_ref, a_smem.at[wg_m], b_smem.at[wg_n].T)
        else:
          plgpu.wgmma(acc_ref, a_smem.at[wg_m], b_smem.at[:, wg_n])
        if hooks.k_step is not None:
          (kk,) = idxs
          hooks.k_step(kk, a_smem)
        return acc_ref

      def matmul(a_rows_ref, row):
        make_pipeline(mma_body, compute_context, n_idx, hooks.before_load,
                      loop_info.local_index * grid.k_iters,
                      owner=tile.owner)(
            a_rows_ref.at[pl.ds(row, cta_tile_m), :],
            b_columns(cta_n),
            allocations=pipeline_allocs)

      hooks.run(matmul)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
