"""The matmul core alone, on one GPU: how far our kernels' GEMM is from cuBLAS.

A ring kernel at D devices runs the gathered GEMM `[D * m, k] @ [k, n]`
(all-gather) or `[D * m, k] @ [k, n]` summed over devices (reduce-scatter)
while it sends. This script takes the communication away: each kernel runs
on a one-device mesh (no ring, no sends, no barrier) on the whole GEMM
M x K x N, with the config `selection` picks for the D = 2 ring at that
shape, and is timed against
  cublas     XLA's dot on the same GEMM (the bound's GEMM),
  upstream   JAX's `hopper_matmul_mgpu` with the same tiles, with no
             cluster and with 2-block clusters sharing A (cluster along n)
             or B (cluster along m) through TMA multicast.
So `ours_ag / cublas` is what the GEMM core costs before any communication,
and the cluster rows say whether multicast would buy anything at the shape.
Every result is checked against an f32 reference, with outputs poisoned.

  python scripts/bench_gemm_core.py --shapes 16384/4096/2048 --out core.json
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import collective_matmul as cm
from collective_matmul import kernels
from collective_matmul import selection
from collective_matmul.autotuning import kernel_time_us

cm.prepare_xla_for_kernels()

# Whole GEMMs of MaxText llama2-7b at tensor-sequence 2 (16384 tokens):
# q/k/v, fused q/k/v, wi, the attention output and the MLP output.
SHAPES = ["16384/4096/2048", "16384/4096/6144", "16384/4096/5504",
          "16384/2048/4096", "16384/5504/4096", "2048/4096/4096"]


def rel_error(out, ref):
  out = np.asarray(out, np.float32)
  if not np.isfinite(out).all():
    return float("inf")
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def poison(nbytes):
  junk = jnp.full((nbytes // 4 + 1024,), jnp.nan, jnp.float32)
  junk.block_until_ready()
  del junk


def upstream_config(cfg, cluster):
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  dim = {"m": hm.MatmulDimension.M, "n": hm.MatmulDimension.N}
  return hm.TuningConfig(
      tile_m=cfg.tile_m, tile_n=cfg.tile_n, tile_k=cfg.tile_k,
      max_concurrent_steps=cfg.max_concurrent_steps,
      epi_tile_m=cfg.epi_tile_m, epi_tile_n=cfg.epi_tile_n,
      grid_minor_dim=dim[cfg.grid_minor_dim],
      grid_tile_width=cfg.grid_tile_width,
      wg_dimension=dim[cfg.wg_dimension],
      cluster_dimension=None if cluster is None else dim[cluster])


def bench(shape, args):
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  big_m, k, n = map(int, shape.split("/"))
  dtype = jnp.bfloat16
  dev = jax.devices()[0]
  mesh = jax.make_mesh((1,), ("x",), devices=[dev],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  a = jax.device_put(jax.random.normal(jax.random.key(1), (big_m, k), dtype),
                     dev)
  b = jax.device_put(jax.random.normal(jax.random.key(2), (k, n), dtype), dev)
  ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  row = {"shape": shape, "flops": 2 * big_m * k * n}

  def run(name, f, cfg=None):
    try:
      poison(big_m * n * 4)
      out, t, names = kernel_time_us(f, a, b, iterations=args.iterations)
    except Exception as e:  # A config that does not fit is reported.
      print(f"{shape} {name} failed: {type(e).__name__}: {str(e)[:300]}",
            flush=True)
      row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
      return
    err = rel_error(out, ref)
    row[f"{name}_us"], row[f"{name}_rel_err"] = t, err
    row[f"{name}_kernels"] = names
    if cfg is not None:
      row[f"{name}_config"] = cfg
    if not err < 2e-2:
      print(f"!! {shape} {name}: rel err {err}", flush=True)
    print(f"{shape:>18} {name:<14} {t:9.1f} us  err {err:.1e}", flush=True)

  run("cublas", jax.jit(jnp.dot))
  m_shard = big_m // 2
  ag = selection.select_config(m_shard, k, n, dtype, 2)
  ag_core = dataclasses.replace(ag, sender_sms=0)
  rs = selection.select_reduce_scatter_config(m_shard, k, n, dtype, 2)
  with jax.set_mesh(mesh):
    shmap = lambda fn: jax.jit(jax.shard_map(
        fn, in_specs=(P(), P()), out_specs=P(), check_vma=False))
    run("ours_ag", shmap(functools.partial(
        kernels.all_gather_lhs_matmul, axis_name="x", config=ag_core)),
        dataclasses.asdict(ag))
    run("ours_rs", shmap(functools.partial(
        kernels.matmul_reduce_scatter, axis_name="x", config=rs)),
        dataclasses.asdict(rs))
  for cluster in (None, "m", "n"):
    cfg = upstream_config(ag_core, cluster)
    run(f"upstream_{cluster or 'none'}", jax.jit(
        lambda x, y, cfg=cfg: hm.matmul(x, y, None, config=cfg)),
        str(cfg))
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="*", default=SHAPES,
                      help="whole GEMMs M/K/N (bf16)")
  parser.add_argument("--iterations", type=int, default=10)
  parser.add_argument("--out", default="gemm_core.json")
  args = parser.parse_args()
  for shape in args.shapes:
    dims = shape.split("/")
    if len(dims) != 3 or not all(x.isdigit() and int(x) > 0 for x in dims):
      parser.error(f"--shapes {shape!r}: expected M/K/N, three positive "
                   "integers (e.g. 16384/4096/2048)")
  if args.iterations < 1:
    parser.error("--iterations must be >= 1")
  rows = []
  meta = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
          "time": time.strftime("%Y-%m-%d %H:%M:%S")}
  for shape in args.shapes:
    rows.append(bench(shape, args))
    with open(args.out, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
  names = ["ours_ag", "ours_rs", "upstream_none", "upstream_m", "upstream_n"]
  print("\n| M/K/N | cuBLAS us | " + " | ".join(f"{x} / cuBLAS" for x in names)
        + " |")
  print("|---" * (len(names) + 2) + "|")
  for r in rows:
    base = r.get("cublas_us")
    cells = [f"{r[x + '_us'] / base:.3f}" if base and x + "_us" in r else "-"
             for x in names]
    print(f"| {r['shape']} | {base or 0:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
