"""What runs for one collective matmul, forward only: the plan's `impl`
(the XLA baseline, the portable `ppermute` ring or the Hopper kernel) with
the plan's config, looked up in `IMPLEMENTATIONS`, the kernels handed
their operands in the plan's layouts.

No differentiation here (`primitives` wraps these in the rules every JAX
transformation needs) and no decision (the caller passes the plan). Call
inside `shard_map`.
"""
from __future__ import annotations

import math
import types
from typing import Any, Callable, NamedTuple

from jax import lax
import jax.numpy as jnp

from collective_matmul import ring
from collective_matmul import selection
from collective_matmul.enums import Collective
from collective_matmul.enums import Impl
from collective_matmul.enums import RowLayout
from collective_matmul.enums import WeightLayout
from collective_matmul.plan import KernelPlan


def _given(**keywords):
  """The keywords whose value is not None."""
  return {name: value for name, value in keywords.items()
          if value is not None}


def _weight_for_kernel(w, layout: WeightLayout, scale, row_scale=None,
                       col_scale=None):
  """(the weight as the kernels take it in `layout`, the keywords that say
  how, each passed only when set): `[k, n]` as given, or `[n, k]` (K-major:
  a weight that arrives as the transpose of a K-major array, the dgrad's
  `w.T`, becomes that array again, XLA folding the two transposes); and
  the scales (`row_scale` already as the kernel's rows, `[rows]`)."""
  options = _given(scale=scale, row_scale=row_scale, col_scale=col_scale)
  if layout == WeightLayout.NK:
    return w.T, dict(options, weight_layout=layout.value)
  return w, options


def _rows_2d(row_scale, axis, moved):
  """`row_scale` (`x.shape[:-1]`) as the kernel's rows: flattened, with
  `axis` first where the plan moves it there; None stays None."""
  if row_scale is None:
    return None
  return (jnp.moveaxis(row_scale, axis, 0) if moved else row_scale).reshape(
      -1)


def _pallas_all_gather_matmul(x, w, axis_name, gather_axis, plan: KernelPlan,
                              precision, preferred_element_type,
                              return_gathered, scale, row_scale=None,
                              col_scale=None):
  # bf16/f16 and fp8 operands always accumulate in f32 on the MMA unit:
  # precision has nothing to select. The kernel hands back the shards it
  # received.
  del precision
  from collective_matmul import kernels  # Imports Pallas Mosaic GPU lazily.
  axis_size = lax.axis_size(axis_name)
  rows = math.prod(x.shape[:-1])
  moved = plan.row_layout == RowLayout.AXIS_FIRST
  if moved:
    x2d, per_batch = jnp.moveaxis(x, gather_axis, 0).reshape(
        rows, x.shape[-1]), None
  else:
    x2d, per_batch = x.reshape(rows, x.shape[-1]), math.prod(
        x.shape[gather_axis:-1])
  w_kernel, options = _weight_for_kernel(
      w, plan.weight_layout, scale, _rows_2d(row_scale, gather_axis, moved),
      col_scale)
  result = kernels.all_gather_lhs_matmul(
      x2d, w_kernel, axis_name, config=plan.config,
      out_dtype=preferred_element_type, rows_per_batch=per_batch,
      return_gathered=return_gathered, **options)
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
                                  plan: KernelPlan, precision,
                                  preferred_element_type, scale,
                                  row_scale=None, col_scale=None):
  del precision  # As for the all-gather kernel.
  from collective_matmul import kernels  # Imports Pallas Mosaic GPU lazily.
  axis_size = ring.check_row_blocks(x, scatter_axis, axis_name)
  rows = math.prod(x.shape[:-1])
  out_shape = list(x.shape[:-1]) + [w.shape[1]]
  out_shape[scatter_axis] //= axis_size
  as_given = plan.row_layout == RowLayout.AS_GIVEN
  w_kernel, options = _weight_for_kernel(
      w, plan.weight_layout, scale,
      _rows_2d(row_scale, scatter_axis, not as_given), col_scale)
  if as_given:
    # Runs of rows are addressed per row block, so they must fit one block.
    per_block = math.prod(x.shape[scatter_axis:-1]) // axis_size
    out2d = kernels.matmul_reduce_scatter(
        x.reshape(rows, x.shape[-1]), w_kernel, axis_name,
        config=plan.config, out_dtype=preferred_element_type,
        rows_per_batch=per_block, **options)
    return out2d.reshape(out_shape)
  moved = jnp.moveaxis(x, scatter_axis, 0)
  lead = moved.shape[:-1]
  out2d = kernels.matmul_reduce_scatter(
      moved.reshape(rows, x.shape[-1]), w_kernel, axis_name,
      config=plan.config, out_dtype=preferred_element_type, **options)
  out = out2d.reshape((lead[0] // axis_size,) + lead[1:] + (w.shape[1],))
  return jnp.moveaxis(out, 0, scatter_axis)


def contract_leading(a, b, precision):
  """`a[..., p].T @ b[..., q]` summed over all leading dimensions, in f32 or
  wider: `[p, q]`."""
  dtype = selection.wider_dtype(a.dtype, b.dtype)
  lead = tuple(range(a.ndim - 1))
  return lax.dot_general(
      a.astype(dtype), b.astype(dtype), ((lead, lead), ((), ())),
      precision=precision,
      preferred_element_type=jnp.promote_types(dtype, jnp.float32))


def _baseline_all_gather_matmul(x, w, axis_name, gather_axis, plan,
                                precision, preferred_element_type,
                                return_gathered, scale, **vector_scales):
  del plan  # The baseline has no config.
  return ring.baseline_all_gather_matmul(
      x, w, axis_name, gather_axis=gather_axis, precision=precision,
      preferred_element_type=preferred_element_type,
      return_gathered=return_gathered, scale=scale, **vector_scales)


def _baseline_matmul_reduce_scatter(x, w, axis_name, scatter_axis, plan,
                                    precision, preferred_element_type, scale,
                                    **vector_scales):
  del plan  # The baseline has no config.
  return ring.baseline_matmul_reduce_scatter(
      x, w, axis_name, scatter_axis=scatter_axis, precision=precision,
      preferred_element_type=preferred_element_type, scale=scale,
      **vector_scales)


def _ring_all_gather_matmul(x, w, axis_name, gather_axis, plan: KernelPlan,
                            precision, preferred_element_type,
                            return_gathered, scale, **vector_scales):
  return ring.ring_all_gather_matmul(
      x, w, axis_name, gather_axis=gather_axis,
      bidirectional=plan.config.bidirectional, precision=precision,
      preferred_element_type=preferred_element_type,
      return_gathered=return_gathered, scale=scale, **vector_scales)


def _ring_matmul_reduce_scatter(x, w, axis_name, scatter_axis,
                                plan: KernelPlan, precision,
                                preferred_element_type, scale,
                                **vector_scales):
  return ring.ring_matmul_reduce_scatter(
      x, w, axis_name, scatter_axis=scatter_axis,
      bidirectional=plan.config.bidirectional, precision=precision,
      preferred_element_type=preferred_element_type, scale=scale,
      **vector_scales)


class Implementation(NamedTuple):
  """One implementation's forward for each collective, run as the plan
  says (its config; for the kernels, how they take the operands):

    all_gather_matmul(x, w, axis_name, gather_axis, plan, precision,
                      preferred_element_type, return_gathered, scale,
                      row_scale=None, col_scale=None)
    matmul_reduce_scatter(x, w, axis_name, scatter_axis, plan, precision,
                          preferred_element_type, scale, row_scale=None,
                          col_scale=None)

  `scale`: None, or a float32 scalar multiplying the f32 accumulation
  before the cast to the result's dtype; `row_scale` (`x.shape[:-1]`) and
  `col_scale` (`[n]`): None, or float32 vectors multiplying its rows and
  columns (`ring`'s module docstring).
  """

  all_gather_matmul: Callable[..., Any]
  matmul_reduce_scatter: Callable[..., Any]


IMPLEMENTATIONS = types.MappingProxyType({
    Impl.BASELINE: Implementation(_baseline_all_gather_matmul,
                                  _baseline_matmul_reduce_scatter),
    Impl.RING: Implementation(_ring_all_gather_matmul,
                              _ring_matmul_reduce_scatter),
    Impl.PALLAS: Implementation(_pallas_all_gather_matmul,
                                _pallas_matmul_reduce_scatter),
})


def collective_matmul(collective: Collective, plan: KernelPlan, x, w,
                      axis_name, axis, precision, preferred_element_type,
                      return_gathered: bool = False, scale=None,
                      row_scale=None, col_scale=None):
  """`collective`'s matmul as the forward of `plan` says: the product (times
  `scale`, `row_scale` and `col_scale`, applied to the f32 accumulation),
  or `(product, all_gather(x))` with `return_gathered` (all-gather only).
  `axis` is the gathered or the scattered dimension of `x`."""
  implementation = IMPLEMENTATIONS[plan.impl]
  # Passed only where given: an implementation that takes no vector scales
  # is never handed any.
  vector_scales = _given(row_scale=row_scale, col_scale=col_scale)
  if collective == Collective.ALL_GATHER:
    return implementation.all_gather_matmul(
        x, w, axis_name, axis, plan, precision, preferred_element_type,
        return_gathered, scale, **vector_scales)
  if return_gathered:
    raise ValueError("only the all-gather matmul gathers its operand")
  return implementation.matmul_reduce_scatter(
      x, w, axis_name, axis, plan, precision, preferred_element_type,
      scale, **vector_scales)


def times_weight_transposed(dy, w):
  """`dy` and `w.T` in one dtype, the wider of the two (an f32 cotangent is
  not rounded to bf16 to meet a bf16 weight)."""
  dtype = selection.wider_dtype(dy.dtype, w.dtype)
  return dy.astype(dtype), w.T.astype(dtype)
