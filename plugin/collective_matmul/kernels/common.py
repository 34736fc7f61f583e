"""Pieces both Hopper kernels share: device facts, layouts, the pipeline."""
from __future__ import annotations

import jax
from jax import lax
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
                    delay_release=1):
  """The warp-specialized k loop: 2 compute warpgroups, 1 memory warpgroup.

  `k_order(step)` gives the k block loaded at pipeline step `step`
  (default: in order). With `delay_release=1` slots are released one step
  late, so a body may still read its slot (e.g. to forward it) during the
  next; that costs one step of prefetch depth, so a kernel that does not
  forward passes 0.
  """
  order = k_order or (lambda kk: kk)
  transforms = swizzled(dtype, tile_k)
  return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(k_iters,),
      memory_registers=40,
      in_specs=[
          plgpu.BlockSpec((cta_tile_m, tile_k), lambda kk: (0, order(kk)),
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
  )


def kernel_call(body, out_types):
  """A persistent kernel: one block per SM, 3 warpgroups."""
  return plgpu.kernel(
      body,
      out_type=out_types,
      grid=(num_sms(),),
      grid_names=("cluster_grid",),
      cluster=(1,),
      cluster_names=("cluster",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
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
  if smem > configs.SMEM_BYTES:
    raise ValueError(f"{config} needs {smem} bytes of shared memory, more "
                     f"than the {configs.SMEM_BYTES} a Hopper block has")


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
