"""Pieces both Hopper kernels share: device facts, layouts, the pipeline."""
from __future__ import annotations

import jax
from jax import lax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp


def num_sms() -> int:
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None and getattr(device, "num_cores", None):
    return device.num_cores
  return jax.devices()[0].core_count


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
                    k_iters, dtype, max_concurrent_steps, k_order=None):
  """The warp-specialized k loop: 2 compute warpgroups, 1 memory warpgroup.

  `k_order(step)` gives the k block loaded at pipeline step `step`
  (default: in order). Slots are released one step late (delay_release=1)
  so a body may still read its slot (e.g. to forward it) during the next.
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
                          delay_release=1),
          plgpu.BlockSpec((tile_k, cta_tile_n), lambda kk: (order(kk), 0),
                          transforms=transforms, memory_space=plgpu.SMEM,
                          delay_release=1),
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


def ring_neighbours(axis_name, axis_size):
  """(this device's index, the index it sends to) on the ring d -> d - 1."""
  dev = lax.axis_index(axis_name)
  return dev, lax.rem(dev + axis_size - 1, axis_size)
