"""Differentiable collective matmuls, one entry point per collective.

Call these inside `shard_map` (over at least `axis_name`). The implementation
is chosen by the `impl` argument, never from global state: `pallas` (the
Hopper kernel), `ring` (portable `ppermute` ring) or `baseline` (the XLA
collective, then one dot).
"""
from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp

from collective_matmul import ring

ALL_GATHER_IMPLS = ("pallas", "ring", "baseline")


def _check_all_gather_operands(x, w, gather_axis, impl):
  if impl not in ALL_GATHER_IMPLS:
    raise ValueError(f"impl={impl!r} is not one of {ALL_GATHER_IMPLS}")
  if x.ndim < 2 or w.ndim != 2:
    raise ValueError(f"expected x[..., k] with ndim >= 2 and w[k, n], got "
                     f"x{x.shape} and w{w.shape}")
  if x.shape[-1] != w.shape[0]:
    raise ValueError(f"contraction sizes differ: x{x.shape} has k="
                     f"{x.shape[-1]}, w{w.shape} has k={w.shape[0]}")
  if not 0 <= gather_axis < x.ndim - 1:
    raise ValueError(f"gather_axis={gather_axis} must index one of the "
                     f"{x.ndim - 1} leading dimensions of x{x.shape}")


def _pallas_all_gather_matmul(x, w, axis_name, gather_axis, precision,
                              preferred_element_type, kernel_config):
  # The kernel works on 2-D row blocks: bring the gathered dimension first so
  # every device's shard is a contiguous block of rows, then restore.
  from collective_matmul import kernels  # Imports Pallas Mosaic GPU lazily.
  del precision  # bf16/f16 operands always accumulate in f32 on the MMA unit.
  axis_size = lax.axis_size(axis_name)
  moved = jnp.moveaxis(x, gather_axis, 0)
  lead_shape = moved.shape[:-1]
  x2d = moved.reshape(math.prod(lead_shape), x.shape[-1])
  out2d = kernels.all_gather_lhs_matmul(
      x2d, w, axis_name, config=kernel_config,
      out_dtype=preferred_element_type)
  out = out2d.reshape((axis_size * lead_shape[0],) + lead_shape[1:]
                      + (w.shape[1],))
  return jnp.moveaxis(out, 0, gather_axis)


def _all_gather_matmul_impl(x, w, axis_name, gather_axis, impl, bidirectional,
                            precision, preferred_element_type, kernel_config):
  if impl == "baseline":
    return ring.baseline_all_gather_matmul(
        x, w, axis_name, gather_axis=gather_axis, precision=precision,
        preferred_element_type=preferred_element_type)
  if impl == "ring":
    return ring.ring_all_gather_matmul(
        x, w, axis_name, gather_axis=gather_axis, bidirectional=bidirectional,
        precision=precision, preferred_element_type=preferred_element_type)
  return _pallas_all_gather_matmul(x, w, axis_name, gather_axis, precision,
                                   preferred_element_type, kernel_config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7, 8))
def _all_gather_matmul(x, w, axis_name, gather_axis, impl, bidirectional,
                       precision, preferred_element_type, kernel_config):
  return _all_gather_matmul_impl(x, w, axis_name, gather_axis, impl,
                                 bidirectional, precision,
                                 preferred_element_type, kernel_config)


def _all_gather_matmul_fwd(x, w, axis_name, gather_axis, impl, bidirectional,
                           precision, preferred_element_type, kernel_config):
  out = _all_gather_matmul_impl(x, w, axis_name, gather_axis, impl,
                                bidirectional, precision,
                                preferred_element_type, kernel_config)
  return out, (x, w)


def _all_gather_matmul_bwd(axis_name, gather_axis, impl, bidirectional,
                           precision, preferred_element_type, kernel_config,
                           residuals, dy):
  # y = all_gather(x) @ w, so dx = reduce_scatter(dy @ w.T) and
  # dw = all_gather(x).T @ dy. XLA's collectives serve the backward for now.
  del impl, bidirectional, preferred_element_type, kernel_config
  x, w = residuals
  dx_full = lax.dot_general(dy, w, (((dy.ndim - 1,), (1,)), ((), ())),
                            precision=precision)
  dx = lax.psum_scatter(dx_full, axis_name, scatter_dimension=gather_axis,
                        tiled=True).astype(x.dtype)
  x_full = lax.all_gather(x, axis_name, axis=gather_axis, tiled=True)
  lead = tuple(range(x.ndim - 1))
  dw = lax.dot_general(x_full, dy, ((lead, lead), ((), ())),
                       precision=precision).astype(w.dtype)
  return dx, dw


_all_gather_matmul.defvjp(_all_gather_matmul_fwd, _all_gather_matmul_bwd)


def all_gather_matmul(x, w, axis_name, *, gather_axis: int = 0,
                      impl: str = "ring", bidirectional: bool = True,
                      precision=None, preferred_element_type=None,
                      kernel_config=None):
  """`all_gather(x, axis_name, axis=gather_axis, tiled=True) @ w`, overlapped.

  Use inside `shard_map`. Differentiable (`jax.grad` gives the same dx and
  dw as through the baseline).

  Args:
    x: local activation shard `[..., k]`; `gather_axis` is the leading
      dimension sharded over `axis_name` (batch, sequence or rows).
    w: local weight columns `[k, n]`.
    axis_name: the mesh axis to gather over.
    gather_axis: which dimension of `x` is gathered.
    impl: `pallas` (Hopper kernel), `ring` (portable) or `baseline`.
    bidirectional: for `ring` with more than two devices, send both ways.
    precision, preferred_element_type: as in `lax.dot_general`.
    kernel_config: a `kernels.AllGatherMatmulConfig` for `pallas`, or None to
      pick one for the shape.

  Returns:
    `[..., n]` with `gather_axis` D times longer, blocks in axis-index order.
  """
  _check_all_gather_operands(x, w, gather_axis, impl)
  return _all_gather_matmul(x, w, axis_name, gather_axis, impl, bidirectional,
                            precision, preferred_element_type, kernel_config)
