"""Differentiable collective matmuls, one entry point per collective.

Call these inside `shard_map` (over at least `axis_name`). What runs is a
`selection.KernelPlan`, carried as the ops' one static argument: the drop-in
`dot_general` passes the plan it chose and recorded; a direct call without
one gets it from `selection.choose`, once, at the public op, from its
`impl` argument (`pallas`: the Hopper kernel, `ring`: the portable
`ppermute` ring, `baseline`: the XLA collective, then one dot). Below the
public ops nothing decides again: the kernels receive the plan's configs.

The two collectives are each other's transpose, so each one's backward runs
the other with the same `impl`: for y = all_gather(x) @ w,
dx = reduce_scatter(dy @ w.T); for y = reduce_scatter(x @ w),
dx = all_gather(dy) @ w.T. Both weight gradients need a gathered operand
(all_gather(x).T @ dy and x.T @ all_gather(dy)); `save_gathered` says whether
the one the collective matmul already assembled is kept for that (memory) or
gathered again (time).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from collective_matmul import ring
from collective_matmul import selection
from collective_matmul.enums import Collective
from collective_matmul.enums import Impl

# What the ops run (`auto` is the override's, resolved by `selection`).
OP_IMPLS = (Impl.PALLAS, Impl.RING, Impl.BASELINE)


def _check_operands(x, w, axis, axis_arg):
  """Validates a collective op's local operands (`axis` is `axis_arg`'s
  value)."""
  if x.ndim < 2 or w.ndim != 2:
    raise ValueError(f"expected x[..., k] with ndim >= 2 and w[k, n], got "
                     f"x{x.shape} and w{w.shape}")
  if x.shape[-1] != w.shape[0]:
    raise ValueError(f"contraction sizes differ: x{x.shape} has k="
                     f"{x.shape[-1]}, w{w.shape} has k={w.shape[0]}")
  if not 0 <= axis < x.ndim - 1:
    raise ValueError(f"{axis_arg}={axis} must index one of the "
                     f"{x.ndim - 1} leading dimensions of x{x.shape}")


def _plan(collective: Collective, x, w, axis_name, axis, impl, kernel_config,
          backward_impl, preferred_element_type, plan):
  """The plan a public op runs: the caller's `plan`, else `selection.choose`
  for these operands from `impl` (and `kernel_config`, `backward_impl`)."""
  if plan is not None:
    if not isinstance(plan, selection.KernelPlan):
      raise TypeError(f"plan must be a selection.KernelPlan, got {plan!r}")
    if (impl, kernel_config, backward_impl) != (None, None, None):
      raise TypeError("give either plan or impl/kernel_config/"
                      "backward_impl, not both")
    return plan
  impl = Impl.parse(Impl.RING if impl is None else impl, "impl", OP_IMPLS)
  backward_impl = (None if backward_impl is None else
                   Impl.parse(backward_impl, "backward_impl", OP_IMPLS))
  axis_size = lax.axis_size(axis_name)
  rows = math.prod(x.shape[:-1])
  if collective == Collective.REDUCE_SCATTER:
    rows //= axis_size  # The kernels see the rows after the scatter.
  problem = selection.Problem(
      max(1, rows), max(1, x.shape[-1]), max(1, w.shape[-1]),
      jnp.dtype(x.dtype), axis_size,
      None if preferred_element_type is None
      else jnp.dtype(preferred_element_type))
  device = selection.device_facts()
  chosen = selection.choose(impl, collective, problem, device,
                            config=kernel_config)
  if chosen.is_fallback:
    raise ValueError(
        "impl='pallas' runs the Hopper (sm_90a: H100, H200) kernel on "
        "bf16 or f16 operands with XLA's command buffers off; here: "
        f"{chosen.reason.removeprefix('pallas unavailable: ')}. Use "
        "impl='ring' (any backend) or 'baseline'.")
  if backward_impl is None or backward_impl == chosen.backward_impl:
    return chosen
  if backward_impl != Impl.PALLAS:
    return dataclasses.replace(chosen, backward_impl=backward_impl,
                               backward_config=None, backward_source="")
  back = selection.choose(Impl.PALLAS, collective.transpose,
                          problem.backward(), device)
  if back.is_fallback:
    raise ValueError(f"backward_impl='pallas' cannot run here: "
                     f"{back.reason}")
  return dataclasses.replace(chosen, backward_impl=Impl.PALLAS,
                             backward_config=back.config,
                             backward_source=back.source)


def _rows_layout(x, axis, config):
  """How the 2-D kernels see `x[..., k]` split on dimension `axis`.

  Returns (x2d, rows_per_batch, moved): with `moved` False, x2d is a free
  reshape and `rows_per_batch` rows (dimension `axis` and everything after
  it but k) form one contiguous run per leading index, which the kernels
  address directly; else `axis` was moved first (a transposing copy), for
  shapes whose runs do not fit the tiles.
  """
  rows = math.prod(x.shape[:-1])
  per_batch = math.prod(x.shape[axis:-1])
  if axis == 0 or selection.supports_rows_per_batch(config, rows, per_batch):
    return x.reshape(rows, x.shape[-1]), per_batch, False
  moved = jnp.moveaxis(x, axis, 0)
  return moved.reshape(rows, x.shape[-1]), None, True


def _pallas_all_gather_matmul(x, w, axis_name, gather_axis,
                              preferred_element_type, config,
                              return_gathered=False):
  from collective_matmul import kernels  # Imports Pallas Mosaic GPU lazily.
  axis_size = lax.axis_size(axis_name)
  x2d, per_batch, moved = _rows_layout(x, gather_axis, config)
  result = kernels.all_gather_lhs_matmul(
      x2d, w, axis_name, config=config,
      out_dtype=preferred_element_type, rows_per_batch=per_batch,
      return_gathered=return_gathered)
  out2d, held = result if return_gathered else (result, None)
  gathered_shape = list(x.shape)
  gathered_shape[gather_axis] *= axis_size
  if moved:
    lead = jnp.moveaxis(x, gather_axis, 0).shape[:-1]
    out = out2d.reshape((axis_size * lead[0],) + lead[1:] + (w.shape[1],))
    out = jnp.moveaxis(out, 0, gather_axis)
  else:
    out = out2d.reshape(tuple(gathered_shape[:-1]) + (w.shape[1],))
  if not return_gathered:
    return out
  # held[t] is device t's shard as the kernel saw it (2-D rows).
  if moved:
    lead = jnp.moveaxis(x, gather_axis, 0).shape
    held = held.reshape((axis_size,) + lead)
    gathered = jnp.moveaxis(held, 1, gather_axis + 1)
  else:
    held = held.reshape((axis_size,) + x.shape)
    gathered = jnp.moveaxis(held, 0, gather_axis)
  return out, gathered.reshape(gathered_shape)


def _pallas_matmul_reduce_scatter(x, w, axis_name, scatter_axis,
                                  preferred_element_type, config):
  from collective_matmul import kernels  # Imports Pallas Mosaic GPU lazily.
  axis_size = ring.check_row_blocks(x, scatter_axis, axis_name)
  # Runs of rows are addressed per row block, so they must fit one block.
  per_block = math.prod(x.shape[scatter_axis:-1]) // axis_size
  rows = math.prod(x.shape[:-1])
  out_shape = list(x.shape[:-1]) + [w.shape[1]]
  out_shape[scatter_axis] //= axis_size
  if scatter_axis == 0 or selection.supports_rows_per_batch(
      config, rows // axis_size, per_block):
    out2d = kernels.matmul_reduce_scatter(
        x.reshape(rows, x.shape[-1]), w, axis_name, config=config,
        out_dtype=preferred_element_type, rows_per_batch=per_block)
    return out2d.reshape(out_shape)
  moved = jnp.moveaxis(x, scatter_axis, 0)
  lead = moved.shape[:-1]
  out2d = kernels.matmul_reduce_scatter(
      moved.reshape(rows, x.shape[-1]), w, axis_name, config=config,
      out_dtype=preferred_element_type)
  out = out2d.reshape((lead[0] // axis_size,) + lead[1:] + (w.shape[1],))
  return jnp.moveaxis(out, 0, scatter_axis)


def _contract_leading(a, b, precision):
  """`a[..., p].T @ b[..., q]` summed over all leading dimensions, in f32 or
  wider: `[p, q]`."""
  dtype = jnp.promote_types(a.dtype, b.dtype)
  lead = tuple(range(a.ndim - 1))
  return lax.dot_general(
      a.astype(dtype), b.astype(dtype), ((lead, lead), ((), ())),
      precision=precision,
      preferred_element_type=jnp.promote_types(dtype, jnp.float32))


def _all_gather_matmul_impl(x, w, axis_name, gather_axis, impl, config,
                            bidirectional, precision, preferred_element_type,
                            return_gathered=False):
  """The product, or `(product, all_gather(x))` with `return_gathered`;
  `config`: the kernel's, for `pallas`."""
  if impl == Impl.BASELINE:
    return ring.baseline_all_gather_matmul(
        x, w, axis_name, gather_axis=gather_axis, precision=precision,
        preferred_element_type=preferred_element_type,
        return_gathered=return_gathered)
  if impl == Impl.RING:
    return ring.ring_all_gather_matmul(
        x, w, axis_name, gather_axis=gather_axis, bidirectional=bidirectional,
        precision=precision, preferred_element_type=preferred_element_type,
        return_gathered=return_gathered)
  # bf16/f16 operands always accumulate in f32 on the MMA unit: precision
  # has nothing to select. The kernel hands back the shards it received.
  return _pallas_all_gather_matmul(x, w, axis_name, gather_axis,
                                   preferred_element_type, config,
                                   return_gathered)


def _matmul_reduce_scatter_impl(x, w, axis_name, scatter_axis, impl, config,
                                bidirectional, precision,
                                preferred_element_type):
  if impl == Impl.BASELINE:
    return ring.baseline_matmul_reduce_scatter(
        x, w, axis_name, scatter_axis=scatter_axis, precision=precision,
        preferred_element_type=preferred_element_type)
  if impl == Impl.RING:
    return ring.ring_matmul_reduce_scatter(
        x, w, axis_name, scatter_axis=scatter_axis,
        bidirectional=bidirectional, precision=precision,
        preferred_element_type=preferred_element_type)
  return _pallas_matmul_reduce_scatter(x, w, axis_name, scatter_axis,
                                       preferred_element_type, config)


def _times_weight_transposed(dy, w):
  """`dy` and `w.T` in one dtype, the wider of the two (an f32 cotangent is
  not rounded to bf16 to meet a bf16 weight)."""
  dtype = jnp.promote_types(dy.dtype, w.dtype)
  return dy.astype(dtype), w.T.astype(dtype)


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything of one op call but its operands: the one non-differentiable
  (hashable) argument of the custom_vjp functions.

  `axis` is the gathered (all-gather) or scattered (reduce-scatter)
  dimension of `x`; `plan` what runs forward and backward; the other fields
  are the public ops' arguments.
  """

  axis_name: Any
  axis: int
  plan: selection.KernelPlan
  bidirectional: bool
  precision: Any
  preferred_element_type: Any
  save_gathered: bool

  def forward_args(self):
    """The `_*_impl` functions' arguments after the operands."""
    return (self.axis_name, self.axis, self.plan.impl, self.plan.config,
            self.bidirectional, self.precision, self.preferred_element_type)

  def backward_args(self, out_dtype):
    """The backward's `_*_impl` arguments after the operands: the plan's
    backward, writing `out_dtype`."""
    return (self.axis_name, self.axis, self.plan.backward_impl,
            self.plan.backward_config, self.bidirectional, self.precision,
            out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _all_gather_matmul(x, w, static: _Static):
  return _all_gather_matmul_impl(x, w, *static.forward_args())


def _all_gather_matmul_fwd(x, w, static: _Static):
  if static.save_gathered:
    out, gathered = _all_gather_matmul_impl(x, w, *static.forward_args(),
                                            return_gathered=True)
    return out, (gathered, w)
  return _all_gather_matmul_impl(x, w, *static.forward_args()), (x, w)


def _all_gather_matmul_bwd(static: _Static, residuals, dy):
  # y = all_gather(x) @ w, so dx = reduce_scatter(dy @ w.T), the other
  # collective matmul, as the plan's backward says, and
  # dw = all_gather(x).T @ dy, from the gathered activation the forward
  # saved or after gathering it again.
  x_or_gathered, w = residuals
  x_dtype = x_or_gathered.dtype
  dy_b, w_t = _times_weight_transposed(dy, w)
  dx = _matmul_reduce_scatter_impl(dy_b, w_t,
                                   *static.backward_args(x_dtype))
  gathered = x_or_gathered if static.save_gathered else lax.all_gather(
      x_or_gathered, static.axis_name, axis=static.axis, tiled=True)
  dw = _contract_leading(gathered, dy, static.precision).astype(w.dtype)
  return dx.astype(x_dtype), dw


_all_gather_matmul.defvjp(_all_gather_matmul_fwd, _all_gather_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_reduce_scatter(x, w, static: _Static):
  return _matmul_reduce_scatter_impl(x, w, *static.forward_args())


def _matmul_reduce_scatter_fwd(x, w, static: _Static):
  return _matmul_reduce_scatter_impl(x, w, *static.forward_args()), (x, w)


def _matmul_reduce_scatter_bwd(static: _Static, residuals, dy):
  # y = reduce_scatter(x @ w), so dx = all_gather(dy) @ w.T, the all-gather
  # collective matmul, and dw = x.T @ all_gather(dy), from the gathered dy
  # that one assembled or after a second all-gather.
  x, w = residuals
  dy_b, w_t = _times_weight_transposed(dy, w)
  dx_and_maybe_gathered = _all_gather_matmul_impl(
      dy_b, w_t, *static.backward_args(x.dtype),
      return_gathered=static.save_gathered)
  if static.save_gathered:
    dx, gathered_dy = dx_and_maybe_gathered
  else:
    dx = dx_and_maybe_gathered
    gathered_dy = lax.all_gather(dy_b, static.axis_name, axis=static.axis,
                                 tiled=True)
  dw = _contract_leading(x, gathered_dy, static.precision).astype(w.dtype)
  return dx.astype(x.dtype), dw


_matmul_reduce_scatter.defvjp(_matmul_reduce_scatter_fwd,
                              _matmul_reduce_scatter_bwd)

_PLAN_ARGS_DOC = """
    impl: `pallas` (Hopper kernel), `ring` (portable, the default) or
      `baseline`; with `pallas` the backward takes the kernel where it runs
      and pays off, else XLA's (`selection.choose`).
    kernel_config: a kernel config for `pallas`, or None to pick one for
      the shape (`selection.config_for`).
    backward_impl: implementation of the backward's collective matmul, or
      None for `impl`'s choice.
    plan: a `selection.KernelPlan` (what the drop-in `dot_general` chose),
      instead of `impl`, `kernel_config` and `backward_impl`."""


def all_gather_matmul(x, w, axis_name, *, gather_axis: int = 0,
                      impl: Impl | str | None = None,
                      bidirectional: bool = True,
                      precision=None, preferred_element_type=None,
                      kernel_config=None, save_gathered: bool = True,
                      backward_impl: Impl | str | None = None,
                      plan: selection.KernelPlan | None = None):
  """`all_gather(x, axis_name, axis=gather_axis, tiled=True) @ w`, overlapped.

  Use inside `shard_map`. Differentiable (`jax.grad` gives the same dx and
  dw as through the baseline). The backward computes
  dx = reduce_scatter(dy @ w.T) with `matmul_reduce_scatter`.

  Args:
    x: local activation shard `[..., k]`; `gather_axis` is the leading
      dimension sharded over `axis_name` (batch, sequence or rows).
    w: local weight columns `[k, n]`.
    axis_name: the mesh axis to gather over.
    gather_axis: which dimension of `x` is gathered.
    bidirectional: for `ring` with more than two devices, send both ways.
    precision, preferred_element_type: as in `lax.dot_general`.
    save_gathered: (default, as in `CollectiveMatmulConfig`) keep the
      gathered activation `all_gather(x)` from the forward for the weight
      gradient: D x the activation shard's memory,
      held until the backward (`pallas` keeps the shards its ring received;
      the other impls gather them). False: the backward gathers `x` again
      (one more all-gather's time).{plan_args}

  Returns:
    `[..., n]` with `gather_axis` D times longer, blocks in axis-index order.
  """
  _check_operands(x, w, gather_axis, "gather_axis")
  plan = _plan(Collective.ALL_GATHER, x, w, axis_name, gather_axis, impl,
               kernel_config, backward_impl, preferred_element_type, plan)
  return _all_gather_matmul(x, w, _Static(
      axis_name, gather_axis, plan, bidirectional, precision,
      preferred_element_type, save_gathered))


def matmul_reduce_scatter(x, w, axis_name, *, scatter_axis: int = 0,
                          impl: Impl | str | None = None,
                          bidirectional: bool = True,
                          precision=None, preferred_element_type=None,
                          kernel_config=None, save_gathered: bool = True,
                          backward_impl: Impl | str | None = None,
                          plan: selection.KernelPlan | None = None):
  """`psum_scatter(x @ w, axis_name, scatter_dimension=scatter_axis,
  tiled=True)`, overlapped.

  Use inside `shard_map`. Differentiable (`jax.grad` gives the same dx and
  dw as through the baseline). The backward computes
  dx = all_gather(dy) @ w.T with `all_gather_matmul`'s implementation.

  Args:
    x: local activation `[..., k]`: every row, and this device's slice of
      the contraction (e.g. the MLP's hidden features).
    w: local weight rows `[k, n]`: the same slice of the contraction.
    axis_name: the mesh axis the contraction is sharded over and the result
      is scattered over.
    scatter_axis: the leading dimension of `x` the result is scattered on
      (batch, sequence or rows); its size must divide by the axis size.
    bidirectional: for `ring` with more than two devices, sum from both
      sides at once, halving the sequential steps.
    precision, preferred_element_type: as in `lax.dot_general`. `ring` sums
      the D partial products in float32 (or the wider
      `preferred_element_type`) and casts once at the end; `baseline` sums
      in the product's dtype, as XLA's reduce-scatter does.
    save_gathered: (default, as in `CollectiveMatmulConfig`) in the
      backward, use the gathered cotangent that the dx all-gather matmul
      assembles for dw too (D x the cotangent shard's
      memory while dw is computed). False: gather dy again for dw (one more
      all-gather's time).{plan_args}

  Returns:
    `[..., n]` with `scatter_axis` D times shorter: row block d of the sum
    over the axis, on device d.
  """
  _check_operands(x, w, scatter_axis, "scatter_axis")
  plan = _plan(Collective.REDUCE_SCATTER, x, w, axis_name, scatter_axis,
               impl, kernel_config, backward_impl, preferred_element_type,
               plan)
  return _matmul_reduce_scatter(x, w, _Static(
      axis_name, scatter_axis, plan, bidirectional, precision,
      preferred_element_type, save_gathered))


all_gather_matmul.__doc__ = all_gather_matmul.__doc__.format(
    plan_args=_PLAN_ARGS_DOC)
matmul_reduce_scatter.__doc__ = matmul_reduce_scatter.__doc__.format(
    plan_args=_PLAN_ARGS_DOC)
