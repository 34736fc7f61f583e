"""Autotune the Hopper kernel for local shapes and cache the winners on disk.

  python scripts/autotune.py --shapes 1024/4096/4096 4096/8192/7168 [--dtype bf16]
  python scripts/autotune.py --collective reduce_scatter --shapes 1024/4096/4096
  python scripts/autotune.py --shapes 8192/4096/11008 --rounds 5  # finalists
  python scripts/autotune.py --dtype fp8 --shapes 8192/2048/4096

  python scripts/autotune.py --plan 2 --shapes 1024/4096/4096  # no GPU

Uses all local GPUs as one ring (mesh axis "x"); without Hopper GPUs it
says so and exits 1. The cache path is
$COLLECTIVE_MATMUL_TUNING_CACHE or ~/.cache/collective_matmul/tuning.json.
With --plan D nothing runs on a GPU: every candidate the sweep would time
at D devices, and the ring it checks them against, is traced on emulated
CPU devices and, with JAX >= 0.12, lowered for CUDA (`bench_plan`);
candidates over shared memory are listed as failed (the sweep skips
those), anything else that fails would stop it.
"""
import argparse
import os
import sys

import script_setup  # pylint: disable=g-bad-import-order

script_setup.prepare()  # CPU devices for --plan; packages from the checkout.
# The plan check is a GPU tool's (tools/bench_plan.py).
sys.path.insert(0, os.path.join(script_setup.REPO_ROOT, "tools"))

import jax  # pylint: disable=g-bad-import-order

from collective_matmul import autotuning
from collective_matmul import selection
import bench_plan  # pylint: disable=g-bad-import-order


def parse_shape(text):
  """--shapes' 'm/k/n' -> (m, k, n) (the dtype is --dtype's)."""
  if ":" in text:
    raise ValueError(f"--shapes {text!r}: expected m/k/n (the dtype is "
                     "--dtype's)")
  return bench_plan.parse_shape(text)[:3]


# --dtype fp8: the all-gather's e4m3 x e4m3, the reduce-scatter's e5m2 x
# e4m3 (a gradient times a weight), bf16 results.
FP8 = "fp8"


def problem_for(args, m, k, n, d):
  """The sweep's `selection.Problem` for --dtype and --collective."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  if args.dtype != FP8:
    return selection.Problem(m, k, n, bench_plan.DTYPES[args.dtype], d)
  if args.collective == "all_gather":
    return selection.Problem(m, k, n, jnp.float8_e4m3fn, d, jnp.bfloat16)
  return selection.Problem(m, k, n, jnp.float8_e5m2, d, jnp.bfloat16,
                           jnp.float8_e4m3fn)


def ring_reference(collective, fp8=False):
  """The portable ring the sweep checks every candidate against (impl
  "ring" of the op), in shard_map over "x"; for fp8 taking the weight
  K-major and the scale, as the sweep's candidates do."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import collective_matmul as cm  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  op, out_spec = ((cm.all_gather_matmul, P(None, "x"))
                  if collective == "all_gather" else
                  (cm.matmul_reduce_scatter, P("x", None)))
  if fp8:
    fn = lambda x, w_nk, s: op(x, w_nk.T, "x", impl="ring", scale=s,
                               preferred_element_type=jnp.bfloat16)
  else:
    fn = lambda x, w: op(x, w, "x", impl="ring")
  return jax.shard_map(fn, out_specs=out_spec, check_vma=False)


def plan_calls(args, d):
  """What the sweep runs at D devices: per shape, its candidates
  (`bench_plan.Call`s) and the ring reference (`bench_plan.FnCall`)."""
  fp8 = args.dtype == FP8
  calls = []
  for text in args.shapes:
    m, k, n = parse_shape(text)
    problem = problem_for(args, m, k, n, d)
    label = f"{args.collective} {text}"
    candidates = [
        bench_plan.fp8_ring_call(f"{label} #{i}", args.collective, config,
                                 m, k, n, d) if fp8 else
        bench_plan.ring_call(f"{label} #{i}", args.collective, config, m, k,
                             n, d, problem.dtype)
        for i, config in enumerate(autotuning.candidate_configs(
            args.collective, problem,
            device=bench_plan.planned_device(devices=d)))]
    calls += candidates
    first = candidates[0]
    calls.append(bench_plan.FnCall(
        f"{label} ring", ring_reference(args.collective, fp8), first.shapes,
        first.in_specs, d, first.dtype))
  return calls


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", required=True,
                      help="local m/k/n per shard")
  parser.add_argument("--dtype", default="bf16", choices=["bf16", "f16", FP8],
                      help="operands (fp8: e4m3 x e4m3 for the all-gather, "
                      "e5m2 x e4m3 for the reduce-scatter, bf16 results)")
  parser.add_argument("--iterations", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=1,
                      help="time the sweep's fastest --finalists this many "
                      "times round-robin and keep the best median (one "
                      "reading each cannot rank configs a few %% apart)")
  parser.add_argument("--finalists", type=int, default=3)
  parser.add_argument("--collective", "--pattern", default="all_gather",
                      choices=list(autotuning.COLLECTIVES),
                      help="which kernel: all_gather (shapes: shard m/k/n) "
                      "or reduce_scatter (m rows after the scatter/k/n)")
  parser.add_argument("--plan", type=int, default=None, metavar="D",
                      help="no GPU: trace (and where JAX can, lower for "
                      "CUDA) every candidate at D devices on emulated CPU "
                      "devices; exit 1 if any fails")
  args = parser.parse_args()
  try:
    for text in args.shapes:
      parse_shape(text)
  except ValueError as e:
    parser.error(str(e))
  for flag in ("iterations", "finalists", "rounds"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag} {getattr(args, flag)}: must be >= 1")
  if args.plan is not None:
    if args.plan < 1:
      parser.error(f"--plan {args.plan}: the devices must be >= 1")
    sys.exit(1 if bench_plan.check_plan(plan_calls(args, args.plan)) else 0)
  device = selection.device_facts()
  if device.platform not in ("gpu", "cuda") or not device.is_hopper:
    sys.exit(f"autotune.py: the sweep needs Hopper GPUs (found "
             f"{device.device_kind!r}); `--plan D` shows the sweep")
  mesh = jax.make_mesh((jax.device_count(),), ("x",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  for text in args.shapes:
    m, k, n = parse_shape(text)
    problem = problem_for(args, m, k, n, jax.device_count())
    best, results = autotuning.autotune(problem, mesh, "x",
                                        iterations=args.iterations,
                                        collective=args.collective,
                                        rounds=args.rounds,
                                        finalists=args.finalists)
    for name, us in sorted(results.items(), key=lambda kv: kv[1])[:5]:
      print(f"{text}: {us:8.1f} us  {name}")
    print(f"{text}: best {best}")


if __name__ == "__main__":
  main()
