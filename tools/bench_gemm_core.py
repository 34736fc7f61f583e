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
`--variant NAME=JSON` adds `ours_NAME`: the all-gather core config with the
JSON's fields replaced (e.g. `nochain={"chain_tiles": false}`), or with a
name starting `rs_` the reduce-scatter's, to see which tiling choice costs
what. With `--rounds R` every method of a shape is timed
R times round-robin and the median is reported (clocks drift between
back-to-back readings). With `--plan` nothing runs on a GPU: every call the same arguments would
time (cuBLAS, our kernels, upstream's matmul) is traced on a CPU device, and lowered for CUDA where
JAX can (>= 0.12), so a variant that cannot run fails here, not in device
time (`bench_plan`). With `--trace-dir DIR` each of our configs runs
again under `kernels.trace_warpgroups` (`--trace-warmups` calls first): its
warpgroup trace goes to DIR and
its per-tile figures (`warpgroup_trace.summarize`: k loop, epilogue, the gap
between tiles, the blocks' spans) into the row as `ours_*_trace`. With
`--power-seconds S` every method then runs back to back for S seconds while
`nvidia-smi` samples the GPU (`gpu_clocks.sustained`): the SM clock and
power it holds, and its share of the tensor cores' peak in cycles at that
clock, go into the row as `*_clock` (these GEMMs are power-bound: a kernel
that loads more per flop runs at a lower clock). Every
result is checked against an f32 reference, with outputs poisoned.

  python tools/bench_gemm_core.py --shapes 16384/4096/2048 --out core.json
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import tool_setup  # pylint: disable=g-bad-import-order

tool_setup.prepare()  # CPU devices for --plan; packages from the checkout.

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from collective_matmul import kernels
from collective_matmul import selection
from collective_matmul.autotuning import kernel_time_us
import bench_plan  # pylint: disable=g-bad-import-order
import gpu_clocks  # pylint: disable=g-bad-import-order
import warpgroup_trace  # pylint: disable=g-bad-import-order

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
  """Upstream's `TuningConfig` with the tiles of our config `cfg` (an
  `AllGatherConfig`), clustered along `cluster` (None, "m" or "n")."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # pylint: disable=g-import-not-at-top
  dim = {"m": hm.MatmulDimension.M, "n": hm.MatmulDimension.N}
  return hm.TuningConfig(
      tile_m=cfg.tile_m, tile_n=cfg.tile_n, tile_k=cfg.tile_k,
      max_concurrent_steps=cfg.max_concurrent_steps,
      epi_tile_m=cfg.epi_tile_m, epi_tile_n=cfg.epi_tile_n,
      grid_minor_dim=dim[cfg.grid_minor_dim],
      grid_tile_width=cfg.grid_tile_width,
      wg_dimension=dim[cfg.wg_dimension],
      cluster_dimension=None if cluster is None else dim[cluster])


def parse_variant(text):
  """NAME=JSON (`--variant`) -> (name, {field: value})."""
  name, sep, fields = text.partition("=")
  if not sep or not name.isidentifier():
    raise ValueError(f"--variant {text!r}: expected NAME=JSON")
  fields = json.loads(fields)
  if not isinstance(fields, dict):
    raise ValueError(f"--variant {text!r}: the JSON must be an object")
  return name, fields


def core_ag_config(big_m, k, n, device=None):
  """The all-gather config `selection` picks for the D = 2 ring at this
  GEMM (m = M / 2 per shard), with the senders (and what only they use)
  off: one device has no ring. Also returns the picked config."""
  ag = selection.select_config(big_m // 2, k, n, jnp.bfloat16, 2,
                               device=device)
  return dataclasses.replace(ag, sender_sms=0, k_major_sends=False,
                             sender_announce_lag=None), ag


def our_configs(big_m, k, n, variants, device=None):
  """[(name, kernel, config, record)] of our kernels a shape times: the
  all-gather's core config ("ours_ag", recorded as the picked one), the
  reduce-scatter's ("ours_rs"), then each --variant ("ours_NAME"; rs_*
  vary the reduce-scatter's config, else the all-gather's). A variant whose
  fields do not apply has its error in place of the config."""
  ag_core, ag = core_ag_config(big_m, k, n, device)
  rs = selection.select_reduce_scatter_config(big_m // 2, k, n, jnp.bfloat16,
                                              2, device=device)
  out = [("ours_ag", kernels.all_gather_lhs_matmul, ag_core, ag),
         ("ours_rs", kernels.matmul_reduce_scatter, rs, rs)]
  for name, fields in variants:
    kernel, base = ((kernels.matmul_reduce_scatter, rs)
                    if name.startswith("rs_") else
                    (kernels.all_gather_lhs_matmul, ag_core))
    try:
      cfg = dataclasses.replace(base, **fields)
    except (TypeError, ValueError) as e:
      cfg = e
    out.append((f"ours_{name}", kernel, cfg, cfg))
  return out


def cublas_matmul():
  """The cuBLAS arm: XLA's dot of the whole GEMM on one device."""
  return jax.jit(jnp.dot)


def upstream_arms(big_m, k, n, skip=False, device=None):
  """[(name, fn, config)] of upstream's Hopper matmul the run times: the
  all-gather core config's tiles with no cluster and with 2-block
  clusters along m and n (none with `skip`)."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # pylint: disable=g-import-not-at-top
  arms = []
  for cluster in (() if skip else (None, "m", "n")):
    core, _ = core_ag_config(big_m, k, n, device)
    cfg = upstream_config(core, cluster)
    arms.append((f"upstream_{cluster or 'none'}", jax.jit(
        lambda x, y, cfg=cfg: hm.matmul(x, y, None, config=cfg)), cfg))
  return arms


def plan_calls(args):
  """Every call the run would time, as `bench_plan` checks them on one
  device: cuBLAS, our kernels (H100/H200's 132 SMs for the trace ranges)
  and upstream's Hopper matmul (which reads the SM count from the device:
  132 too)."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # pylint: disable=g-import-not-at-top
  calls = []
  for shape in args.shapes:
    big_m, k, n = map(int, shape.split("/"))
    operands = dict(shapes=[(big_m, k), (k, n)], in_specs=[P(), P()],
                    devices=1)
    calls.append(bench_plan.FnCall(f"{shape} cublas", cublas_matmul(),
                                   **operands))
    device = bench_plan.planned_device(devices=1)
    for name, kernel, cfg, _ in our_configs(big_m, k, n, args.variant,
                                            device):
      label = f"{shape} {name}"
      if isinstance(cfg, Exception):
        calls.append(bench_plan.Broken(label, 1,
                                       f"{type(cfg).__name__}: {cfg}"))
        continue
      calls.append(bench_plan.Call(
          label, kernel, cfg, [(big_m, k), (k, n)], [P(), P()], P(), 1,
          trace_ranges=trace_ranges(cfg, big_m, n, 132)
          if args.trace_dir else None))
    try:
      arms = upstream_arms(big_m, k, n, args.skip_upstream, device)
    except Exception as e:  # pylint: disable=broad-except
      calls.append(bench_plan.Broken(f"{shape} upstream", 1,
                                     f"{type(e).__name__}: {e}"))
      continue
    calls += [bench_plan.FnCall(f"{shape} {name}", fn, config=cfg,
                                gpu_facts=(hm,), **operands)
              for name, fn, cfg in arms]
  return calls


def bench(shape, args):
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

  timed = {}  # name -> f, for the further rounds
  ours = {}  # name -> (kernel, config), for --trace-dir

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
    row[f"{name}_rounds_us"] = [t]
    row[f"{name}_kernels"] = names
    timed[name] = f
    if cfg is not None:
      row[f"{name}_config"] = cfg
    if not err < 2e-2:
      print(f"!! {shape} {name}: rel err {err}", flush=True)
    print(f"{shape:>18} {name:<14} {t:9.1f} us  err {err:.1e}", flush=True)

  run("cublas", cublas_matmul())
  with jax.set_mesh(mesh):
    shmap = lambda fn: jax.jit(jax.shard_map(
        fn, in_specs=(P(), P()), out_specs=P(), check_vma=False))
    for name, kernel, cfg, record in our_configs(big_m, k, n, args.variant):
      if isinstance(cfg, Exception):  # Reported, like a misfit.
        row[f"{name}_error"] = f"{type(cfg).__name__}: {cfg}"
        print(f"{shape} {name}: {cfg}", flush=True)
        continue
      ours[name] = (kernel, cfg)
      run(name, shmap(functools.partial(kernel, axis_name="x", config=cfg)),
          dataclasses.asdict(record))
  for name, f, cfg in upstream_arms(big_m, k, n, args.skip_upstream):
    run(name, f, str(cfg))
  for _ in range(args.rounds - 1):
    for name, f in timed.items():
      with jax.set_mesh(mesh):
        _, t, _ = kernel_time_us(f, a, b, iterations=args.iterations)
      row[f"{name}_rounds_us"].append(t)
  for name in timed:
    row[f"{name}_us"] = statistics.median(row[f"{name}_rounds_us"])
  if args.rounds > 1:
    print(f"{shape:>18} medians over {args.rounds} rounds: " + ", ".join(
        f"{name} {row[name + '_us']:.1f}" for name in timed), flush=True)
  if args.power_seconds:
    for name, f in timed.items():
      with jax.set_mesh(mesh):
        clock = gpu_clocks.sustained(lambda f=f: f(a, b), args.power_seconds)
      if clock:
        clock["tensor_share"] = round(gpu_clocks.tensor_share(
            row["flops"], row[f"{name}_us"], clock["sm_mhz"],
            jax.devices()[0].core_count), 4)
        print(f"{shape:>18} {name:<14} sustained: {clock['sm_mhz']:.0f} MHz, "
              f"{clock['power_w']:.0f} W, {clock['temp_c']:.0f} C, "
              f"tensor share {clock['tensor_share']:.3f} "
              f"({clock['reasons']})", flush=True)
      row[f"{name}_clock"] = clock
  if args.trace_dir:
    for name, (kernel, cfg) in ours.items():
      if name in timed:
        trace(row, name, kernel, cfg, a, b, ref, mesh, args)
  return row


def trace_ranges(cfg, big_m, n, num_sms):
  """Ranges per warpgroup a traced call needs: the k loop and epilogue of
  each of a block's tiles, and a margin."""
  tiles = math.ceil(big_m / cfg.cta_tile_m) * math.ceil(n / cfg.cta_tile_n)
  return 2 * math.ceil(tiles / num_sms) + 4


def trace(row, name, kernel, cfg, a, b, ref, mesh, args):
  """Runs `kernel` once more under `trace_warpgroups`; keeps its trace in
  --trace-dir, its summary in the row, and checks its result too."""
  big_m, n = a.shape[0], b.shape[1]
  ranges = trace_ranges(cfg, big_m, n, jax.devices()[0].core_count)
  dest = os.path.join(args.trace_dir,
                      f"{row['shape'].replace('/', 'x')}_{name}.json")

  def build():
    return jax.jit(jax.shard_map(
        functools.partial(kernel, axis_name="x", config=cfg),
        in_specs=(P(), P()), out_specs=P(), check_vma=False))

  try:
    poison(big_m * n * 4)
    out, summary = warpgroup_trace.run_traced(
        build, (a, b), ranges, dest, mesh=mesh,
        warmup_calls=args.trace_warmups)
  except Exception as e:  # Reported: e.g. no room for the trace.
    row[f"{name}_trace_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"{row['shape']} {name} trace failed: {e}", flush=True)
    return
  summary["rel_err"] = rel_error(out, ref)
  if not summary["rel_err"] < 2e-2:
    print(f"!! {row['shape']} {name} traced: rel err {summary['rel_err']}",
          flush=True)
  row[f"{name}_trace"] = summary
  print(f"{row['shape']:>18} {name:<14} " + warpgroup_trace.one_line(summary)
        + f" (untraced {row[name + '_us']:.1f} us)", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="*", default=SHAPES,
                      help="whole GEMMs M/K/N (bf16)")
  parser.add_argument("--iterations", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=1,
                      help="time every method this many times, round-robin;"
                      " report the median")
  parser.add_argument("--variant", action="append", default=[],
                      metavar="NAME=JSON",
                      help="also time the all-gather core config (rs_NAME: "
                      "the reduce-scatter's) with these fields replaced, as "
                      "ours_NAME (repeatable)")
  parser.add_argument("--skip-upstream", action="store_true",
                      help="do not time JAX's hopper matmul")
  parser.add_argument("--trace-warmups", type=int, default=1,
                      help="with --trace-dir: calls run (their traces "
                      "dropped) before the traced one kept")
  parser.add_argument("--trace-dir", default=None,
                      help="also trace each of our configs once (warpgroup "
                      "phases) into this directory")
  parser.add_argument("--power-seconds", type=float, default=0,
                      help="then run every method back to back this long "
                      "while sampling its SM clock and power (nvidia-smi)")
  parser.add_argument("--plan", action="store_true",
                      help="no GPU: trace (and where JAX can, lower for "
                      "CUDA) every call this run would time, "
                      "on an emulated CPU device; exit 1 if any fails")
  parser.add_argument("--out", default="gemm_core.json")
  args = parser.parse_args()
  try:
    args.variant = [parse_variant(v) for v in args.variant]
  except ValueError as e:
    parser.error(str(e))
  for shape in args.shapes:
    try:
      if ":" in shape:
        raise ValueError("bf16 only")
      bench_plan.parse_shape(shape)
    except ValueError:
      parser.error(f"--shapes {shape!r}: expected M/K/N, three positive "
                   "integers (e.g. 16384/4096/2048)")
  if args.iterations < 1 or args.rounds < 1 or args.trace_warmups < 0:
    parser.error("--iterations and --rounds must be >= 1, --trace-warmups "
                 ">= 0")
  if args.power_seconds < 0:
    parser.error(f"--power-seconds {args.power_seconds} must be >= 0")
  if args.plan:
    sys.exit(1 if bench_plan.check_plan(plan_calls(args)) else 0)
  if args.trace_dir:
    os.makedirs(args.trace_dir, exist_ok=True)
  rows = []
  meta = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
          "time": time.strftime("%Y-%m-%d %H:%M:%S")}
  for shape in args.shapes:
    rows.append(bench(shape, args))
    with open(args.out, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
  names = ["ours_ag", "ours_rs"] + [f"ours_{v}" for v, _ in args.variant]
  if not args.skip_upstream:
    names += ["upstream_none", "upstream_m", "upstream_n"]
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
