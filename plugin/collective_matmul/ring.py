"""Portable collective matmuls: `lax.ppermute` rings inside `shard_map`.

These are the executable specification of the Hopper kernels (same algorithm,
any backend) and their fallback. Every function here runs inside a
`shard_map` body over `axis_name` and sees local shards only.

All-gather matmul: `x` is `[..., k]` with the gathered dimension
`gather_axis` among the leading ones; `w` is `[k, n]` (the device's columns).
The result has the shape of `x` with `k` replaced by `n` and `gather_axis`
grown D times, its blocks in axis-index order, exactly like
`all_gather(x, tiled=True) @ w`.

Matmul reduce-scatter: `x` is `[..., k]` with every row but only the device's
slice of the contraction `k`; `w` is `[k, n]` (the same slice of its rows).
The result has the shape of `x` with `k` replaced by `n` and `scatter_axis`
D times shorter: device d holds row block d of the sum over devices, exactly
like `psum_scatter(x @ w, scatter_dimension=scatter_axis, tiled=True)`.

`scale`: None, or a float32 scalar (the same on every device) that the
float32 (or wider) accumulation is multiplied by before it is cast to the
result's dtype, as the kernels' epilogue applies it (fp8: the product of
the operands' per-tensor scales).

`row_scale`, `col_scale`: None, or float32 vectors, one per row of `x`
(shape `x.shape[:-1]`: the local rows) and one per column of `w` (`[n]`);
entry `[i, j]` of the float32 accumulation is multiplied by `row_scale[i]
* col_scale[j]` (then by `scale`) before the cast (rowwise fp8: Qwix's
per-row activation and per-column weight scales). The all-gather ring
passes each shard's row scales on with its rows; the reduce-scatter ring
applies them to each partial product before it travels (every device
holds the same row and column scales there).
"""
from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp

from collective_matmul.kernels.configs import is_fp8


@dataclasses.dataclass(frozen=True)
class RingConfig:
  """How the portable ring runs (what a `selection.KernelPlan` carries for
  `ring`).

  bidirectional: on an axis of more than two devices, send half of each
  block each way round, halving the sequential steps.
  """

  bidirectional: bool = True

  def __post_init__(self):
    if not isinstance(self.bidirectional, bool):
      raise TypeError(f"{self.bidirectional=} must be True or False")


def scaled(acc, scale=None, row_scale=None, col_scale=None):
  """`acc[..., n]` times `row_scale[...]` per row, `col_scale[n]` per
  column and the scalar `scale` (each where given), in `acc`'s dtype."""
  if row_scale is not None:
    acc = acc * row_scale[..., None].astype(acc.dtype)
  if col_scale is not None:
    acc = acc * col_scale.astype(acc.dtype)
  if scale is not None:
    acc = acc * scale.astype(acc.dtype)
  return acc


def local_matmul(x, w, *, precision=None, preferred_element_type=None,
                 scale=None, row_scale=None, col_scale=None):
  """`x[..., k] @ w[k, n]` as one `dot_general`; with scales, accumulated
  in float32 (or wider), times them (`scaled`), then cast to the result's
  dtype."""
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  if scale is None and row_scale is None and col_scale is None:
    return lax.dot_general(x, w, dims, precision=precision,
                           preferred_element_type=preferred_element_type)
  out_dtype = _product_dtype(x, w, precision, preferred_element_type)
  acc = lax.dot_general(x, w, dims, precision=precision,
                        preferred_element_type=accumulation_dtype(out_dtype))
  return scaled(acc, scale, row_scale, col_scale).astype(out_dtype)


def _product_dtype(x, w, precision, preferred_element_type):
  """The dtype of `local_matmul(x, w)` without a scale."""
  return jax.eval_shape(
      lambda a, b: lax.dot_general(
          a, b, (((a.ndim - 1,), (0,)), ((), ())), precision=precision,
          preferred_element_type=preferred_element_type), x, w).dtype


def baseline_all_gather_matmul(x, w, axis_name, *, gather_axis=0,
                               precision=None, preferred_element_type=None,
                               return_gathered=False, scale=None,
                               row_scale=None, col_scale=None):
  """All-gather `x` (and its `row_scale`) along `gather_axis`, then one
  matmul: what XLA does.

  With `return_gathered`, returns `(product, gathered x)`.
  """
  gathered = lax.all_gather(x, axis_name, axis=gather_axis, tiled=True)
  if row_scale is not None:
    row_scale = lax.all_gather(row_scale, axis_name, axis=gather_axis,
                               tiled=True)
  out = local_matmul(gathered, w, precision=precision,
                     preferred_element_type=preferred_element_type,
                     scale=scale, row_scale=row_scale, col_scale=col_scale)
  return (out, gathered) if return_gathered else out


def _shift(axis_size: int, delta: int) -> list[tuple[int, int]]:
  """ppermute pairs sending each device's value to device (i + delta) % D."""
  return [(i, (i + delta) % axis_size) for i in range(axis_size)]


def ring_all_gather_matmul(x, w, axis_name, *, gather_axis=0,
                           bidirectional=True, precision=None,
                           preferred_element_type=None, return_gathered=False,
                           scale=None, row_scale=None, col_scale=None):
  """`all_gather(x) @ w` as a ring that multiplies while it passes shards on.

  Step i on device d multiplies shard (d + i) % D, which it received from
  device d + 1, while sending it on to device d - 1 (the ring of JAX's
  `jax/experimental/pallas/ops/gpu/collective_matmul_mgpu.py`). With
  `bidirectional` and D > 2 shards travel both ways round, so only
  ceil((D - 1) / 2) communication steps are sequential instead of D - 1.

  With `return_gathered`, returns `(product, gathered x)`: the shards that
  passed through are kept (D x the memory of `x`, no extra communication),
  e.g. for a backward pass that needs `all_gather(x)` again. A shard's
  `row_scale` travels with it (one send of both).
  """
  if not 0 <= gather_axis < x.ndim - 1:
    raise ValueError(f"gather_axis={gather_axis} must index one of the "
                     f"{x.ndim - 1} leading dimensions of x{x.shape}")
  axis_size = lax.axis_size(axis_name)
  # A chunk is a shard's rows, with their row scales where given.
  dot = lambda chunk: local_matmul(
      chunk[0], w, precision=precision,
      preferred_element_type=preferred_element_type, scale=scale,
      row_scale=chunk[1] if len(chunk) > 1 else None, col_scale=col_scale)
  x = (x,) if row_scale is None else (x, row_scale)
  if axis_size == 1:
    return (dot(x), x[0]) if return_gathered else dot(x)
  my_index = lax.axis_index(axis_name)
  rows = x[0].shape[gather_axis]
  out_shape = list(x[0].shape[:-1]) + [w.shape[1]]
  out_shape[gather_axis] *= axis_size
  out_dtype = jax.eval_shape(dot, x).dtype
  out = jnp.zeros(out_shape, out_dtype)
  gathered_shape = list(x[0].shape)
  gathered_shape[gather_axis] *= axis_size
  gathered = (jnp.zeros(gathered_shape, x[0].dtype) if return_gathered
              else None)

  def place(buffer, block, source):
    start = (source % axis_size) * rows
    return lax.dynamic_update_slice_in_dim(buffer, block, start, gather_axis)

  def use(out, gathered, chunk, source):
    """Multiplies the shard of device `source` (and keeps it if asked)."""
    out = place(out, dot(chunk), source)
    if return_gathered:
      gathered = place(gathered, chunk[0], source)
    return out, gathered

  def result(out, gathered):
    return (out, gathered) if return_gathered else out

  # The first send is issued before the first product so the two overlap.
  if not bidirectional or axis_size == 2:
    chunk = x
    for step in range(axis_size):
      incoming = (lax.ppermute(chunk, axis_name, _shift(axis_size, -1))
                  if step < axis_size - 1 else None)
      out, gathered = use(out, gathered, chunk, my_index + step)
      chunk = incoming
    return result(out, gathered)

  forward, backward = x, x
  out, gathered = use(out, gathered, x, my_index)
  num_steps = axis_size // 2
  for step in range(1, num_steps + 1):
    # Last step of an even ring: shard d + D/2 arrives either way; take one.
    both_ways = not (axis_size % 2 == 0 and step == num_steps)
    forward = lax.ppermute(forward, axis_name, _shift(axis_size, -1))
    if both_ways:
      backward = lax.ppermute(backward, axis_name, _shift(axis_size, +1))
    out, gathered = use(out, gathered, forward, my_index + step)
    if both_ways:
      out, gathered = use(out, gathered, backward, my_index - step)
  return result(out, gathered)


def accumulation_dtype(out_dtype):
  """The dtype partial sums travel in: at least float32 for floating types,
  so that D - 1 additions of low-precision partial products do not each
  round to bf16 (or fp8, as an fp8 GEMM accumulates in f32 too); the
  product's own dtype for integers (exact, and wrapping on overflow as
  `lax.dot_general` does)."""
  if not jnp.issubdtype(out_dtype, jnp.inexact):
    return jnp.dtype(out_dtype)
  if is_fp8(out_dtype):  # No implicit promotion.
    return jnp.dtype(jnp.float32)
  return jnp.promote_types(out_dtype, jnp.float32)


def baseline_matmul_reduce_scatter(x, w, axis_name, *, scatter_axis=0,
                                   precision=None,
                                   preferred_element_type=None, scale=None,
                                   row_scale=None, col_scale=None):
  """One matmul, then `psum_scatter` of the product: what XLA does.

  The partial products (each scaled, with scales) are summed by the
  collective in the product's dtype (bf16 operands: bf16 sums), exactly as
  XLA's own reduce-scatter would.
  """
  partial = local_matmul(x, w, precision=precision,
                         preferred_element_type=preferred_element_type,
                         scale=scale, row_scale=row_scale,
                         col_scale=col_scale)
  return lax.psum_scatter(partial, axis_name, scatter_dimension=scatter_axis,
                          tiled=True)


def check_row_blocks(x, scatter_axis, axis_name) -> int:
  """The axis size, after checking `x` splits into that many row blocks."""
  axis_size = lax.axis_size(axis_name)
  if x.shape[scatter_axis] % axis_size:
    raise ValueError(
        f"x{x.shape} dimension scatter_axis={scatter_axis} of size "
        f"{x.shape[scatter_axis]} does not split into {axis_size} row blocks "
        f"over {axis_name!r}")
  return axis_size


def ring_matmul_reduce_scatter(x, w, axis_name, *, scatter_axis=0,
                               bidirectional=True, precision=None,
                               preferred_element_type=None, scale=None,
                               row_scale=None, col_scale=None):
  """`psum_scatter(x @ w)` as a ring that adds while it passes sums on.

  Each row block's partial sum travels round the ring towards the device
  that owns it: at every step a device multiplies its slice of the block
  bound for a device further along, adds the partial sum it received for
  that block and sends it on (the send of one step is issued before the
  next step's product, so the two overlap). The owner adds its own product
  last. D products, D - 1 sequential sends.

  With `bidirectional` and D > 2 each block is summed from both sides at
  once: one partial sum collects the devices after the owner (travelling to
  lower indices), the other the devices before it (travelling to higher
  indices), so only ceil((D - 1) / 2) sends are sequential. Every term is
  added exactly once; only the order of the additions differs.

  Partial sums are accumulated and sent in float32 (or in
  `preferred_element_type` when that is wider), whatever the operand dtype,
  and cast to the product's dtype (`preferred_element_type`, else the
  operands') once, at the end. That doubles the bytes sent for bf16 operands
  and is what makes the result no less accurate than one f32 sum. `scale`
  multiplies that sum before the cast; `row_scale` and `col_scale` multiply
  each partial product before it is added and sent on.
  """
  if not 0 <= scatter_axis < x.ndim - 1:
    raise ValueError(f"scatter_axis={scatter_axis} must index one of the "
                     f"{x.ndim - 1} leading dimensions of x{x.shape}")
  axis_size = check_row_blocks(x, scatter_axis, axis_name)
  out_dtype = _product_dtype(x, w, precision, preferred_element_type)
  sum_dtype = accumulation_dtype(out_dtype)

  def finish(total):
    if scale is not None:
      total = total * scale.astype(total.dtype)
    return total.astype(out_dtype)
  rows = x.shape[scatter_axis] // axis_size

  def partial_product(owner):
    """This device's term of row block `owner` (device index, any int)."""
    start = (owner % axis_size) * rows
    block = lax.dynamic_slice_in_dim(x, start, rows, scatter_axis)
    block_scale = (None if row_scale is None else lax.dynamic_slice_in_dim(
        row_scale, start, rows, scatter_axis))
    return scaled(local_matmul(block, w, precision=precision,
                               preferred_element_type=sum_dtype),
                  row_scale=block_scale, col_scale=col_scale)

  if axis_size == 1:
    return finish(partial_product(0))
  my_index = lax.axis_index(axis_name)
  if not bidirectional or axis_size == 2:
    # Every block's sum visits the D - 1 devices after its owner.
    down_hops, up_hops = axis_size - 1, 0
  else:
    down_hops = axis_size // 2
    up_hops = axis_size - 1 - down_hops

  # A sum that ends with `hops` sends starts `hops` devices away from its
  # owner. Both run to the same last step so their final sends overlap the
  # owner's own product; the shorter one starts later.
  down_sum = up_sum = None
  for step in range(down_hops):
    if down_sum is not None:
      down_sum = lax.ppermute(down_sum, axis_name, _shift(axis_size, -1))
    if up_sum is not None:
      up_sum = lax.ppermute(up_sum, axis_name, _shift(axis_size, +1))
    # This step's down sum belongs to the device `distance` before this one
    # and the up sum to the device `distance` after it; up sums, having
    # fewer hops, start once `distance` has come down to `up_hops`.
    distance = down_hops - step
    down_term = partial_product(my_index - distance)
    down_sum = down_term if down_sum is None else down_sum + down_term
    if distance <= up_hops:
      up_term = partial_product(my_index + distance)
      up_sum = up_term if up_sum is None else up_sum + up_term
  down_sum = lax.ppermute(down_sum, axis_name, _shift(axis_size, -1))
  total = partial_product(my_index) + down_sum
  if up_sum is not None:
    up_sum = lax.ppermute(up_sum, axis_name, _shift(axis_size, +1))
    total = total + up_sum
  return finish(total)
