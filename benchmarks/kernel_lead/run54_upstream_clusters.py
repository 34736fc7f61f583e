"""Run 54 (one H200): do 2-block clusters sharing an operand by TMA multicast
pay at the power cap? JAX's `hopper_matmul_mgpu` with today's tiles (128 x
128 per warpgroup, split on n) and with 64 x 256 warpgroup tiles (split on
m), without a cluster and with clusters along m (sharing B) and n (sharing
A), against cuBLAS: CUPTI time (3 rounds round-robin, medians, checked
against an f32 reference) and the SM clock and power each holds back to
back (`scripts/gpu_clocks.py`). Writes run54_upstream_clusters.json to $OUT.

  PYTHONPATH=plugin:host:scripts python benchmarks/kernel_lead/run54_upstream_clusters.py
"""
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

import collective_matmul as cm
from collective_matmul.autotuning import kernel_time_us
import gpu_clocks

cm.prepare_xla_for_kernels()
SHAPES = ["16384/2048/4096", "16384/4096/4096", "16384/5504/4096"]
M, N = hm.MatmulDimension.M, hm.MatmulDimension.N
TILES = {"w128": dict(tile_m=128, tile_n=128, wg_dimension=N),
         "w256": dict(tile_m=64, tile_n=256, wg_dimension=M)}


def main():
  rows = []
  for shape in SHAPES:
    m, k, n = map(int, shape.split("/"))
    a = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16)
    ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    methods = {"cublas": jax.jit(jnp.dot)}
    for tiles, fields in TILES.items():
      for cluster in (None, M, N):
        cfg = hm.TuningConfig(tile_k=64, max_concurrent_steps=4,
                              epi_tile_m=64, epi_tile_n=64,
                              grid_minor_dim=M, grid_tile_width=8,
                              cluster_dimension=cluster, **fields)
        name = f"{tiles}_{'none' if cluster is None else cluster.name.lower()}"
        methods[name] = jax.jit(
            lambda x, y, cfg=cfg: hm.matmul(x, y, None, config=cfg))
    row = {"shape": shape}
    times = {}
    for name, f in methods.items():
      try:
        out, t, kernels = kernel_time_us(f, a, b, iterations=20)
      except Exception as e:  # Reported (e.g. a cluster that does not fit).
        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(shape, name, "failed:", row[f"{name}_error"], flush=True)
        continue
      out = np.asarray(out, np.float32)
      row[f"{name}_rel_err"] = float(np.linalg.norm(out - ref) /
                                     np.linalg.norm(ref))
      row[f"{name}_kernels"] = kernels
      times[name] = [t]
    for _ in range(2):
      for name in times:
        times[name].append(kernel_time_us(methods[name], a, b,
                                          iterations=20)[1])
    for name, ts in times.items():
      row[f"{name}_rounds_us"] = ts
      row[f"{name}_us"] = statistics.median(ts)
      row[f"{name}_clock"] = gpu_clocks.sustained(
          lambda f=methods[name]: f(a, b), 1.0)
      clock = row[f"{name}_clock"]
      print(f"{shape} {name:<10} {row[name + '_us']:8.1f} us "
            f"x{row[name + '_us'] / row['cublas_us'] if 'cublas_us' in row else 1:.3f}"
            f"  {clock.get('sm_mhz')} MHz {clock.get('power_w')} W"
            f"  err {row[name + '_rel_err']:.1e}", flush=True)
    rows.append(row)
  with open(os.path.join(os.environ.get("OUT", "."),
                         "run54_upstream_clusters.json"), "w") as f:
    json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
