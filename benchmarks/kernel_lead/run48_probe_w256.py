"""Which part of a 64 x 256 warpgroup tile gives wrong results (run 48)."""
import dataclasses, functools, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
import collective_matmul as cm
from collective_matmul import kernels
cm.prepare_xla_for_kernels()
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

M, K, N = 2048, 1024, 1024
a = jax.random.normal(jax.random.key(1), (M, K), jnp.bfloat16)
b = jax.random.normal(jax.random.key(2), (K, N), jnp.bfloat16)
ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1],
                     axis_types=(jax.sharding.AxisType.Explicit,))

def rel(out):
  out = np.asarray(out, np.float32)
  if not np.isfinite(out).all():
    return float("inf"), None
  diff = np.abs(out - ref) > 0.05 * np.abs(ref).max()
  # Which columns / rows (mod 256) are wrong.
  cols = sorted(set((np.nonzero(diff.any(0))[0] % 256).tolist()))
  rows = sorted(set((np.nonzero(diff.any(1))[0] % 128).tolist()))
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref)), (
      f"{diff.mean():.3f} wrong; cols%256 {cols[:3]}..{cols[-3:] if cols else ''} "
      f"({len(cols)}), rows%128 ({len(rows)}) {rows[:3]}")

def ours(name, **fields):
  cfg = kernels.AllGatherConfig(**fields)
  with jax.set_mesh(mesh):
    f = jax.jit(jax.shard_map(functools.partial(
        kernels.all_gather_lhs_matmul, axis_name="x", config=cfg),
        in_specs=(P(), P()), out_specs=P(), check_vma=False))
    try:
      e = rel(f(a, b))
    except Exception as ex:
      e = (f"{type(ex).__name__}: {str(ex)[:200]}",)
  print(f"{name:<28}", *e, flush=True)

ours("w128 (today)", tile_m=128, tile_n=128)
ours("w256 wg m", tile_m=64, tile_n=256, wg_dimension="m")
ours("w256 wg m epi 64x256", tile_m=64, tile_n=256, wg_dimension="m",
     epi_tile_n=256, max_concurrent_steps=2)
ours("w256 wg m epi 64x128", tile_m=64, tile_n=256, wg_dimension="m",
     epi_tile_n=128)
ours("w192 wg m", tile_m=64, tile_n=192, wg_dimension="m")
ours("w256 wg m tk32", tile_m=64, tile_n=256, wg_dimension="m", tile_k=32)
ours("w256 m128 n256 wg n? (64x512)", tile_m=64, tile_n=256,
     max_concurrent_steps=2)
for tm, tn, wg in ((64, 256, hm.MatmulDimension.M), (128, 128, hm.MatmulDimension.N)):
  cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=4,
                        epi_tile_m=64, epi_tile_n=64, wg_dimension=wg,
                        grid_minor_dim=hm.MatmulDimension.M, grid_tile_width=8)
  try:
    e = rel(jax.jit(lambda x, y: hm.matmul(x, y, None, config=cfg))(a, b))
  except Exception as ex:
    e = (f"{type(ex).__name__}: {str(ex)[:200]}",)
  print(f"upstream {tm}x{tn} {wg}", *e, flush=True)
