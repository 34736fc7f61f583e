"""Portable collective matmuls: `lax.ppermute` rings inside `shard_map`.

These are the executable specification of the Hopper kernels (same algorithm,
any backend) and their fallback. Every function here runs inside a
`shard_map` body over `axis_name` and sees local shards only.

Shapes: `x` is `[..., k]` with the gathered dimension `gather_axis` among the
leading ones; `w` is `[k, n]` (the device's columns). The result has the
shape of `x` with `k` replaced by `n` and `gather_axis` grown D times, its
blocks in axis-index order, exactly like `all_gather(x, tiled=True) @ w`.
"""
from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp


def local_matmul(x, w, *, precision=None, preferred_element_type=None):
  """`x[..., k] @ w[k, n]` as one `dot_general`."""
  return lax.dot_general(
      x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision,
      preferred_element_type=preferred_element_type)


def baseline_all_gather_matmul(x, w, axis_name, *, gather_axis=0,
                               precision=None, preferred_element_type=None):
  """All-gather `x` along `gather_axis`, then one matmul: what XLA does."""
  gathered = lax.all_gather(x, axis_name, axis=gather_axis, tiled=True)
  return local_matmul(gathered, w, precision=precision,
                      preferred_element_type=preferred_element_type)


def _shift(axis_size: int, delta: int) -> list[tuple[int, int]]:
  """ppermute pairs sending each device's value to device (i + delta) % D."""
  return [(i, (i + delta) % axis_size) for i in range(axis_size)]


def ring_all_gather_matmul(x, w, axis_name, *, gather_axis=0,
                           bidirectional=True, precision=None,
                           preferred_element_type=None):
  """`all_gather(x) @ w` as a ring that multiplies while it passes shards on.

  Step i on device d multiplies shard (d + i) % D, which it received from
  device d + 1, while sending it on to device d - 1 (the seed's ring). With
  `bidirectional` and D > 2 shards travel both ways round, so only
  ceil((D - 1) / 2) communication steps are sequential instead of D - 1.
  """
  if not 0 <= gather_axis < x.ndim - 1:
    raise ValueError(f"gather_axis={gather_axis} must index one of the "
                     f"{x.ndim - 1} leading dimensions of x{x.shape}")
  axis_size = lax.axis_size(axis_name)
  dot = lambda chunk: local_matmul(
      chunk, w, precision=precision,
      preferred_element_type=preferred_element_type)
  if axis_size == 1:
    return dot(x)
  my_index = lax.axis_index(axis_name)
  rows = x.shape[gather_axis]
  out_shape = list(x.shape[:-1]) + [w.shape[1]]
  out_shape[gather_axis] *= axis_size
  out_dtype = jax.eval_shape(dot, x).dtype
  out = jnp.zeros(out_shape, out_dtype)

  def place(out, block, source):
    start = (source % axis_size) * rows
    return lax.dynamic_update_slice_in_dim(out, block, start, gather_axis)

  # The first send is issued before the first product so the two overlap.
  if not bidirectional or axis_size == 2:
    chunk = x
    for step in range(axis_size):
      incoming = (lax.ppermute(chunk, axis_name, _shift(axis_size, -1))
                  if step < axis_size - 1 else None)
      out = place(out, dot(chunk), my_index + step)
      chunk = incoming
    return out

  forward, backward = x, x
  out = place(out, dot(x), my_index)
  num_steps = axis_size // 2
  for step in range(1, num_steps + 1):
    # Last step of an even ring: shard d + D/2 arrives either way; take one.
    both_ways = not (axis_size % 2 == 0 and step == num_steps)
    forward = lax.ppermute(forward, axis_name, _shift(axis_size, -1))
    if both_ways:
      backward = lax.ppermute(backward, axis_name, _shift(axis_size, +1))
    out = place(out, dot(forward), my_index + step)
    if both_ways:
      out = place(out, dot(backward), my_index - step)
  return out
