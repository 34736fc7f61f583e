"""Autotune the Hopper kernel for local shapes and cache the winners on disk.

  python scripts/autotune.py --shapes 1024/4096/4096 4096/8192/7168 [--dtype bf16]
  python scripts/autotune.py --pattern reduce_scatter --shapes 1024/4096/4096
  python scripts/autotune.py --shapes 8192/4096/11008 --rounds 5  # finalists

Uses all local GPUs as one ring (mesh axis "x"). The cache path is
$COLLECTIVE_MATMUL_TUNING_CACHE or ~/.cache/collective_matmul/tuning.json.
"""
import argparse

import jax
import jax.numpy as jnp

import collective_matmul as cm
from collective_matmul import autotuning

cm.prepare_xla_for_kernels()  # Before JAX starts its GPU backend.


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", required=True,
                      help="local m/k/n per shard")
  parser.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
  parser.add_argument("--iterations", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=1,
                      help="time the sweep's fastest --finalists this many "
                      "times round-robin and keep the best median (one "
                      "reading each cannot rank configs a few %% apart)")
  parser.add_argument("--finalists", type=int, default=3)
  parser.add_argument("--pattern", default="all_gather",
                      choices=list(autotuning.PATTERNS),
                      help="which kernel: all_gather (shapes: shard m/k/n) "
                      "or reduce_scatter (m rows after the scatter/k/n)")
  args = parser.parse_args()
  dtype = {"bf16": jnp.bfloat16, "f16": jnp.float16}[args.dtype]
  mesh = jax.make_mesh((jax.device_count(),), ("x",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  for text in args.shapes:
    m, k, n = map(int, text.split("/"))
    best, results = autotuning.autotune(m, k, n, dtype, mesh, "x",
                                     iterations=args.iterations,
                                     pattern=args.pattern,
                                     rounds=args.rounds,
                                     finalists=args.finalists)
    for name, us in sorted(results.items(), key=lambda kv: kv[1])[:5]:
      print(f"{text}: {us:8.1f} us  {name}")
    print(f"{text}: best {best}")


if __name__ == "__main__":
  main()
