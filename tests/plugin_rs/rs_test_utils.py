"""Meshes, shard_map wrappers and tolerances shared by these tests."""
from __future__ import annotations

import functools
import re

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np

# (data, tensor) mesh shapes: 1-D rings of D devices and the 2-D meshes.
MESH_SHAPES = ((1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (4, 2))


def mesh(data: int, tensor: int, axis_type=AxisType.Auto):
  return jax.make_mesh((data, tensor), ("data", "tensor"),
                       devices=jax.devices()[:data * tensor],
                       axis_types=(axis_type,) * 2)


def cast(array: np.ndarray, dtype) -> jax.Array:
  return jnp.asarray(array, jnp.float32).astype(dtype)


def exact(array) -> np.ndarray:
  """The value an array holds, in float64, for references."""
  return np.asarray(jnp.asarray(array, jnp.float32), np.float64)


def assert_close(actual, expected, *, dtype, scale=None):
  """Equal within the dtype's rounding, relative to the data's magnitude:
  a misplaced or missing row block is off by about `scale` and fails."""
  actual, expected = exact(actual), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  scale = float(np.std(expected)) if scale is None else scale
  tolerance = {"float32": 1e-5, "bfloat16": 3e-2}[jnp.dtype(dtype).name]
  np.testing.assert_allclose(actual, expected, rtol=tolerance,
                             atol=tolerance * scale)


def reduce_scatter_specs(ndim: int, scatter_axis: int):
  """shard_map specs for x[..., F@tensor] @ w[F@tensor, E] -> rows over
  tensor on `scatter_axis`, with batch (dim 0) over data."""
  x_spec = ["data"] + [None] * (ndim - 2) + ["tensor"]
  out_spec = ["data"] + [None] * (ndim - 1)
  if scatter_axis == 0:
    out_spec[0] = ("data", "tensor")
  else:
    out_spec[scatter_axis] = "tensor"
  return (P(*x_spec), P("tensor", None)), P(*out_spec)


def all_gather_specs(ndim: int, gather_axis: int):
  """shard_map specs for x[B@data, S@tensor, E] @ w[E, F@tensor] (rows
  gathered over tensor on `gather_axis`)."""
  x_spec = ["data"] + [None] * (ndim - 1)
  if gather_axis == 0:
    x_spec[0] = ("data", "tensor")
  else:
    x_spec[gather_axis] = "tensor"
  out_spec = ["data"] + [None] * (ndim - 2) + ["tensor"]
  return (P(*x_spec), P(None, "tensor")), P(*out_spec)


def sharded(fn, the_mesh, in_specs, out_spec, **kwargs):
  """`fn(x, w, 'tensor', **kwargs)` as a jitted shard_map over the mesh."""
  body = functools.partial(fn, axis_name="tensor", **kwargs)
  return jax.jit(jax.shard_map(body, mesh=the_mesh, in_specs=in_specs,
                               out_specs=out_spec, check_vma=False))


def count_ops(hlo_text: str, op: str) -> int:
  """How many `op` instructions (sync or async start) a compiled HLO has."""
  return len(re.findall(rf"= \S+ {op}(-start)?\(", hlo_text))
