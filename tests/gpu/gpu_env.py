"""What the GPU suite can run on here, and the helpers its tests share."""
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import jax
import jax.numpy as jnp
import numpy as np


def _hopper_count():
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    return 0
  return sum(any(k in d.device_kind for k in ("H100", "H200", "H800"))
             for d in gpus)


HOPPER_COUNT = _hopper_count()




def ring_mesh(d, data=None):
  """An Explicit mesh "x" over the first d devices in id order (Mosaic GPU
  wants row-major device ids), or ("data", "x") over data * d of them."""
  shape, names = ((d,), ("x",)) if data is None else ((data, d), ("data", "x"))
  devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return jax.sharding.Mesh(
      devices, names,
      axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))


def poison(nbytes):
  """Leave NaN in freed device memory, so an unwritten output shows up."""
  for dev in jax.local_devices():
    junk = jax.device_put(jnp.full((nbytes // 4 + 4096,), jnp.nan), dev)
    junk.block_until_ready()
    del junk


def rel_error(out, ref):
  """||out - ref|| / ||ref||, failing on any unwritten or non-finite value."""
  out = np.asarray(out, np.float32)
  assert np.isfinite(out).all(), "unwritten (poisoned) or non-finite output"
  return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def all_gather_kernel(lhs, rhs, axis_name, *, config=None, **kwargs):
  """The all-gather kernel at `config`, or at the one selection picks for
  the shape (as the ops do)."""
  from jax import lax  # pylint: disable=g-import-not-at-top
  from collective_matmul import kernels, selection  # pylint: disable=g-import-not-at-top
  config = config or selection.select_config(
      lhs.shape[0], lhs.shape[1], rhs.shape[1], lhs.dtype,
      lax.axis_size(axis_name), out_dtype=kwargs.get("out_dtype"))
  return kernels.all_gather_lhs_matmul(lhs, rhs, axis_name, config=config,
                                       **kwargs)


def reduce_scatter_kernel(x, w, axis_name, *, config=None, **kwargs):
  """The reduce-scatter kernel at `config`, or at the one selection picks
  for the shape (as the ops do)."""
  from jax import lax  # pylint: disable=g-import-not-at-top
  from collective_matmul import kernels, selection  # pylint: disable=g-import-not-at-top
  d = lax.axis_size(axis_name)
  config = config or selection.select_reduce_scatter_config(
      x.shape[0] // d, x.shape[1], w.shape[1], x.dtype, d,
      out_dtype=kwargs.get("out_dtype"))
  return kernels.matmul_reduce_scatter(x, w, axis_name, config=config,
                                       **kwargs)
