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
The fp8 arms (unless `--skip-fp8`) time the same GEMM on fp8 operands, the
weight K-major (`[N, K]` e4m3) and a per-tensor f32 scale, bf16 results:
  cublas_fp8     XLA's dot on e4m3 x e4m3 times the scale, as Flax's
                 `fp8_ops` runs it (cuBLASLt's fp8 GEMM),
  cublas_fp8_rs  the same on e5m2 x e4m3 (a gradient times a weight),
  ours_fp8       the all-gather kernel's fp8 core (e4m3 x e4m3),
  ours_fp8_rs    the reduce-scatter kernel's fp8 core (e5m2 x e4m3),
each of ours at the config `selection` picks for the fp8 problem
(`fp8_core_configs`). With `--rowwise` also the same GEMMs scaled rowwise,
by f32 row scales `[M]` and column scales `[N]` (random, in [0.5, 2)) in
place of the per-tensor scale (`rowwise_arms`):
  cublas_fp8_rowwise     XLA's fp8 dot (e4m3 x e4m3) to f32, times the
                         row and column scales, cast to bf16,
  cublas_fp8_rs_rowwise  the same on e5m2 x e4m3,
  ours_fp8_rowwise       the all-gather's fp8 core, the scales in its
                         epilogue, at ours_fp8's config,
  ours_fp8_rs_rowwise    the reduce-scatter's, at ours_fp8_rs's config.
With `--fp8-forward` also an fp8 layer's forward from
bf16 operands, Flax's quantization then XLA's product or ours
(`fp8_forward_arms`), whose kernel breakdown shows what runs beside the
GEMM. `--only ARM...` times only those arms.
`--variant NAME=JSON` adds `ours_NAME`: the all-gather core config with the
JSON's fields replaced (e.g. `nochain={"chain_tiles": false}`), or with a
name starting `rs_` the reduce-scatter's, `fp8_` the all-gather's fp8
core's, `rs_fp8_` the reduce-scatter's fp8 core's, to see which tiling
choice costs what. With `--rounds R` every method of a shape is timed
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
from jax import lax
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
# With llama3-8b's at tensor-sequence 2 (q/k/v fused, the attention output,
# q, wi fused): the ten shapes the core is judged at (tools/gpu_check.sh,
# tools/gpu_installed_setup.sh; tools/rings_one_gpu.py keeps a copy).
TEN_SHAPES = SHAPES + ["16384/4096/7168", "16384/7168/4096",
                       "16384/4096/3072", "16384/4096/14336"]
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# The fp8 arms' per-tensor scales (lhs, rhs): their product is the scale.
FP8_SCALES = (0.75, 1.25)


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
      grid_minor_dim=hm.MatmulDimension.M,  # Ours, always.
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
  return dataclasses.replace(ag, sender_sms=0, k_major_sends=False), ag


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
    if is_fp8_variant(name):
      continue  # `fp8_core_configs`'.
    kernel, base = ((kernels.matmul_reduce_scatter, rs)
                    if name.startswith("rs_") else
                    (kernels.all_gather_lhs_matmul, ag_core))
    try:
      cfg = dataclasses.replace(base, **fields)
    except (TypeError, ValueError) as e:
      cfg = e
    out.append((f"ours_{name}", kernel, cfg, cfg))
  return out


def is_fp8_variant(name):
  return name.startswith(("fp8_", "rs_fp8_"))


def fp8_core_configs(big_m, k, n, variants, device=None):
  """[(name, kernel, config, lhs dtype, kwargs)] of our fp8 cores a shape
  times: the all-gather's ("ours_fp8", e4m3 x e4m3) and the
  reduce-scatter's ("ours_fp8_rs", e5m2 x e4m3), each at the config
  `selection` picks for that fp8 problem's D = 2 ring (bf16 results), with
  the senders off as for the bf16 cores, the weight K-major; then each
  fp8_* / rs_fp8_* --variant on top of those. A variant whose fields do not
  apply has its error in place of the config."""
  ag_pick = selection.select_config(big_m // 2, k, n, E4M3, 2, device=device,
                                    out_dtype=jnp.bfloat16)
  ag_core = dataclasses.replace(ag_pick, sender_sms=0, k_major_sends=False)
  rs_core = selection.select_reduce_scatter_config(
      big_m // 2, k, n, E5M2, 2, device=device, out_dtype=jnp.bfloat16,
      rhs_dtype=E4M3)
  ag = (kernels.all_gather_lhs_matmul, ag_core, E4M3, dict(weight_layout="nk"))
  rs = (kernels.matmul_reduce_scatter, rs_core, E5M2, dict(weight_layout="nk"))
  out = [("ours_fp8", *ag), ("ours_fp8_rs", *rs)]
  for name, fields in variants:
    if not is_fp8_variant(name):
      continue
    kernel, cfg, lhs_dtype, kw = rs if name.startswith("rs_") else ag
    try:
      cfg = dataclasses.replace(cfg, **fields)
    except (TypeError, ValueError) as e:
      cfg = e
    out.append((f"ours_{name}", kernel, cfg, lhs_dtype, kw))
  return out


def fp8_kernel_fn(kernel, cfg, kw):
  """Our fp8 core `kernel(lhs, rhs_nk, scale)` on the current mesh's one
  device (no ring)."""
  return jax.jit(jax.shard_map(
      lambda a, b, s: kernel(a, b, axis_name="x", config=cfg, scale=s, **kw),
      in_specs=(P(), P(), P()), out_specs=P(), check_vma=False))


def cublas_fp8_matmul():
  """The cuBLAS fp8 arm, as Flax's `fp8_ops` computes a product: XLA's dot
  of the fp8 operands (lhs `[M, K]`, rhs `[N, K]`) to bf16, times the
  scale (cuBLASLt's fp8 GEMM, the scale in its epilogue)."""
  def f(a, b_nk, scale):
    out = lax.dot_general(a, b_nk, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.bfloat16)
    return out * scale.astype(jnp.bfloat16)
  return jax.jit(f)


def fp8_arms(big_m, k, n, args, device=None):
  """[(name, fn, config, lhs dtype)] of every fp8 arm a shape times, each
  `fn(lhs, rhs_nk, scale)`; none with `--skip-fp8`. `config` is an
  exception where a variant's fields do not apply."""
  if args.skip_fp8:
    return []
  arms = [("cublas_fp8", cublas_fp8_matmul(), None, E4M3),
          ("cublas_fp8_rs", cublas_fp8_matmul(), None, E5M2)]
  for name, kernel, cfg, lhs_dtype, kw in fp8_core_configs(
      big_m, k, n, args.variant, device):
    fn = None if isinstance(cfg, Exception) else fp8_kernel_fn(kernel, cfg,
                                                               kw)
    arms.append((name, fn, cfg, lhs_dtype))
  return arms


# The rowwise arms' scale vectors are drawn uniform in this range.
ROWWISE_SCALES = (0.5, 2.0)
ROWWISE_ARMS = ("cublas_fp8_rowwise", "cublas_fp8_rs_rowwise",
                "ours_fp8_rowwise", "ours_fp8_rs_rowwise")


def xla_fp8_rowwise_matmul():
  """The XLA rowwise fp8 arm: XLA's dot of the fp8 operands (lhs `[M, K]`,
  rhs `[N, K]`) to f32, times the row scales `[M]` and the column scales
  `[N]`, cast to bf16 (our epilogue's arithmetic, in whatever XLA fuses
  around its GEMM)."""
  def f(a, b_nk, row_scale, col_scale):
    out = lax.dot_general(a, b_nk, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)
    return (out * row_scale[:, None] * col_scale[None, :]).astype(
        jnp.bfloat16)
  return jax.jit(f)


def rowwise_kernel_fn(kernel, cfg, kw):
  """Our fp8 core `kernel(lhs, rhs_nk, row_scale, col_scale)` on the
  current mesh's one device (no ring)."""
  return jax.jit(jax.shard_map(
      lambda a, b, r, c: kernel(a, b, axis_name="x", config=cfg, row_scale=r,
                                col_scale=c, **kw),
      in_specs=(P(),) * 4, out_specs=P(), check_vma=False))


def rowwise_arms(big_m, k, n, args, device=None):
  """[(name, fn, config, lhs dtype)] of the rowwise fp8 arms
  (`ROWWISE_ARMS`), each `fn(lhs, rhs_nk, row_scale, col_scale)`; ours at
  the per-tensor fp8 cores' configs (`fp8_core_configs`). None without
  `--rowwise` or with `--skip-fp8`."""
  if args.skip_fp8 or not args.rowwise:
    return []
  arms = [("cublas_fp8_rowwise", xla_fp8_rowwise_matmul(), None, E4M3),
          ("cublas_fp8_rs_rowwise", xla_fp8_rowwise_matmul(), None, E5M2)]
  for name, kernel, cfg, lhs_dtype, kw in fp8_core_configs(big_m, k, n, [],
                                                           device):
    arms.append((f"{name}_rowwise", rowwise_kernel_fn(kernel, cfg, kw), cfg,
                 lhs_dtype))
  return arms


# Flax's fp8 state per operand: a scale, an amax history of this length.
AMAX_HISTORY = 1024


def fp8_forward_arms(big_m, k, n, device=None, impl="pallas"):
  """[(name, fn)] of an fp8 layer's forward from bf16 operands, as Flax's
  `fp8_ops` runs it: `in_q` of both operands (the scale from the amax
  history, delayed scaling; the quantization to e4m3), then the product:
    xla_fp8_fwd   XLA's dot of the e4m3 operands (cuBLASLt), dequantized
                  after with `out_dq`, Flax's program;
    ours_fp8_fwd  the all-gather op with the `impl` plan (pallas: the
                  kernel) on the one-device axis, the product of the scales
                  in the kernel's epilogue, as `collective_matmul.fp8` runs
                  it: the dispatch hands the kernel the e4m3 weight K-major
                  (`w.T`).
  Each `fn(x [M, K], w [K, N], x_scale, w_scale, x_history, w_history)`;
  the kernels of its CUPTI breakdown show whether the weight's transpose
  is a pass of its own or fused into the quantization."""
  from flax.linen import fp8_ops  # pylint: disable=g-import-not-at-top
  import collective_matmul as cm  # pylint: disable=g-import-not-at-top
  plan = selection.choose(
      impl, "all_gather",
      selection.Problem(big_m, k, n, E4M3, 1, jnp.bfloat16),
      device or selection.device_facts())
  if plan.is_fallback:  # Never XLA's program timed under our name.
    raise ValueError(f"ours_fp8_fwd: {impl} does not run here: "
                     f"{plan.reason}")

  def quantized(x, w, sx, sw, hx, hw):
    qx, sx = fp8_ops.in_q(jnp.bfloat16, E4M3, x, sx, hx)
    qw, sw = fp8_ops.in_q(jnp.bfloat16, E4M3, w, sw, hw)
    return qx, qw, sx, sw

  def xla(*operands):
    qx, qw, sx, sw = quantized(*operands)
    out = lax.dot_general(qx, qw, (((1,), (0,)), ((), ())),
                          preferred_element_type=jnp.bfloat16)
    return fp8_ops.out_dq(jnp.bfloat16, sx, sw, out)

  product = jax.shard_map(
      lambda qx, qw, s: cm.all_gather_matmul(
          qx, qw, "x", plan=plan, scale=s,
          preferred_element_type=jnp.bfloat16),
      in_specs=(P(), P(), P()), out_specs=P(), check_vma=False)

  def ours(*operands):
    qx, qw, sx, sw = quantized(*operands)
    return product(qx, qw, jnp.reshape(sx * sw, ()))

  return [("xla_fp8_fwd", jax.jit(xla)), ("ours_fp8_fwd", jax.jit(ours))]


def fp8_forward_reference(x, w, sx, sw, hx, hw):
  """The f32 product of the e4m3 values `in_q` makes of x and w, times
  the product of the updated scales (full f32 precision)."""
  from flax.linen import fp8_ops  # pylint: disable=g-import-not-at-top
  qx, sx = fp8_ops.in_q(jnp.bfloat16, E4M3, x, sx, hx)
  qw, sw = fp8_ops.in_q(jnp.bfloat16, E4M3, w, sw, hw)
  return jnp.dot(qx.astype(jnp.float32), qw.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST) * (sx * sw)[0]


def fp8_forward_operands(big_m, k, n, dev):
  """x ~ N(0, 1) and w ~ N(0, 0.02) in bf16, scales of 1, empty amax
  histories (Flax's initial fp8 state)."""
  key = jax.random.key(4)
  x = jax.random.normal(jax.random.fold_in(key, 0), (big_m, k), jnp.bfloat16)
  w = (0.02 * jax.random.normal(jax.random.fold_in(key, 1), (k, n),
                                jnp.float32)).astype(jnp.bfloat16)
  one, history = jnp.ones((1,), jnp.float32), jnp.zeros((AMAX_HISTORY,),
                                                         jnp.float32)
  return tuple(jax.device_put(v, dev) for v in (x, w, one, one, history,
                                                 history))


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
    calls += plan_fp8_calls(shape, args, device)
  if args.only:
    calls = [c for c in calls if c.label.split(" ")[1] in args.only]
  return calls


def plan_fp8_calls(shape, args, device):
  """The fp8 arms of one shape as `bench_plan` checks them (our cores
  traced under `trace_warpgroups` too with --trace-dir)."""
  big_m, k, n = map(int, shape.split("/"))
  calls = []
  for name, fn, cfg, lhs_dtype in fp8_arms(big_m, k, n, args, device):
    label = f"{shape} {name}"
    if isinstance(cfg, Exception):
      calls.append(bench_plan.Broken(label, 1,
                                     f"{type(cfg).__name__}: {cfg}"))
      continue
    if cfg is None:  # XLA's fp8 dot (any JAX).
      calls.append(bench_plan.FnCall(
          label, fn, shapes=[(big_m, k), (n, k), ()],
          in_specs=[P(), P(), P()], devices=1,
          dtype=(lhs_dtype, E4M3, jnp.float32)))
      continue
    # Our core: the fp8 ring's call on a one-device axis (the e5m2 x e4m3
    # wgmma needs JAX 0.11).
    calls.append(bench_plan.fp8_ring_call(
        label, "reduce_scatter" if lhs_dtype == E5M2 else "all_gather", cfg,
        big_m, k, n, 1, trace_ranges=trace_ranges(cfg, big_m, n, 132)
        if args.trace_dir else None))
  for name, fn, cfg, lhs_dtype in rowwise_arms(big_m, k, n, args, device):
    label = f"{shape} {name}"
    if cfg is None:
      calls.append(bench_plan.FnCall(
          label, fn, shapes=[(big_m, k), (n, k), (big_m,), (n,)],
          in_specs=[P()] * 4, devices=1,
          dtype=(lhs_dtype, E4M3, jnp.float32, jnp.float32)))
      continue
    calls.append(bench_plan.fp8_ring_call(
        label, "reduce_scatter" if lhs_dtype == E5M2 else "all_gather", cfg,
        big_m, k, n, 1, scales=("row_scale", "col_scale"),
        trace_ranges=trace_ranges(cfg, big_m, n, 132)
        if args.trace_dir else None))
  if args.fp8_forward and not args.skip_fp8:
    operands = dict(
        shapes=[(big_m, k), (k, n), (1,), (1,), (AMAX_HISTORY,),
                (AMAX_HISTORY,)], in_specs=[P()] * 6, devices=1,
        dtype=(jnp.bfloat16,) * 2 + (jnp.float32,) * 4)
    calls += [bench_plan.FnCall(f"{shape} {name}", fn, **operands)
              for name, fn in fp8_forward_arms(big_m, k, n, device)]
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

  timed = {}  # name -> (f, operands), for the further rounds
  ours = {}  # name -> (kernel, config, operands, reference, kwargs)

  def run(name, f, cfg=None, operands=(a, b), reference=ref):
    if args.only and name not in args.only:
      return
    try:
      poison(big_m * n * 4)
      out, t, names = kernel_time_us(f, *operands,
                                     iterations=args.iterations)
    except Exception as e:  # A config that does not fit is reported.
      print(f"{shape} {name} failed: {type(e).__name__}: {str(e)[:300]}",
            flush=True)
      row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
      return
    err = rel_error(out, reference)
    row[f"{name}_us"], row[f"{name}_rel_err"] = t, err
    row[f"{name}_rounds_us"] = [t]
    row[f"{name}_kernels"] = names
    timed[name] = (f, operands)
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
      ours[name] = (kernel, cfg, (a, b), ref, {})
      run(name, shmap(functools.partial(kernel, axis_name="x", config=cfg)),
          dataclasses.asdict(record))
  for name, f, cfg in upstream_arms(big_m, k, n, args.skip_upstream):
    run(name, f, str(cfg))
  if not args.skip_fp8:
    bench_fp8(row, run, ours, mesh, big_m, k, n, args)
  for _ in range(args.rounds - 1):
    for name, (f, operands) in timed.items():
      with jax.set_mesh(mesh):
        _, t, _ = kernel_time_us(f, *operands, iterations=args.iterations)
      row[f"{name}_rounds_us"].append(t)
  for name in timed:
    row[f"{name}_us"] = statistics.median(row[f"{name}_rounds_us"])
  if args.rounds > 1:
    print(f"{shape:>18} medians over {args.rounds} rounds: " + ", ".join(
        f"{name} {row[name + '_us']:.1f}" for name in timed), flush=True)
  if args.power_seconds:
    for name, (f, operands) in timed.items():
      with jax.set_mesh(mesh):
        clock = gpu_clocks.sustained(lambda f=f, x=operands: f(*x),
                                     args.power_seconds)
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
    for name, (kernel, cfg, operands, reference, kw) in ours.items():
      if name in timed:
        trace(row, name, kernel, cfg, operands, reference, mesh, args, kw)
  return row


def bench_fp8(row, run, ours, mesh, big_m, k, n, args):
  """The fp8 arms of one shape (`fp8_arms`), each checked against an f32
  product of the same fp8 values, times the scale."""
  dev = jax.devices()[0]
  key = jax.random.key(3)
  draw = lambda i, shape, dtype: jax.device_put(jax.random.normal(
      jax.random.fold_in(key, i), shape, jnp.float32).astype(dtype), dev)
  lhs = {E4M3: draw(0, (big_m, k), E4M3), E5M2: draw(1, (big_m, k), E5M2)}
  rhs_nk = draw(2, (n, k), E4M3)
  scale = jnp.float32(FP8_SCALES[0] * FP8_SCALES[1])
  refs = {}

  def product(lhs_dtype):
    """The f32 product on the GPU, at full f32 precision, unscaled."""
    if lhs_dtype not in refs:
      refs[lhs_dtype] = np.asarray(jnp.dot(
          lhs[lhs_dtype].astype(jnp.float32), rhs_nk.astype(jnp.float32).T,
          precision=lax.Precision.HIGHEST))
    return refs[lhs_dtype]

  def reference(lhs_dtype):
    return product(lhs_dtype) * np.float32(scale)

  with jax.set_mesh(mesh):
    arms = fp8_arms(big_m, k, n, args)
  for name, fn, cfg, lhs_dtype in arms:
    if isinstance(cfg, Exception):
      row[f"{name}_error"] = f"{type(cfg).__name__}: {cfg}"
      print(f"{row['shape']} {name}: {cfg}", flush=True)
      continue
    operands = (lhs[lhs_dtype], rhs_nk, scale)
    if cfg is not None:
      kw = dict(weight_layout="nk")
      kernel = (kernels.all_gather_lhs_matmul if lhs_dtype == E4M3 else
                kernels.matmul_reduce_scatter)
      ours[name] = (kernel, cfg, operands, reference(lhs_dtype),
                    dict(kw, scale=scale))
    with jax.set_mesh(mesh):
      run(name, fn, None if cfg is None else dataclasses.asdict(cfg),
          operands, reference(lhs_dtype))
  if args.rowwise:
    row_scale, col_scale = (jax.device_put(jax.random.uniform(
        jax.random.fold_in(key, i), (size,), jnp.float32, *ROWWISE_SCALES),
                                           dev)
                            for i, size in ((4, big_m), (5, n)))
    rows, cols = np.asarray(row_scale)[:, None], np.asarray(col_scale)
    rowwise_refs = {}
    with jax.set_mesh(mesh):
      arms = rowwise_arms(big_m, k, n, args)
    for name, fn, cfg, lhs_dtype in arms:
      if lhs_dtype not in rowwise_refs:
        rowwise_refs[lhs_dtype] = product(lhs_dtype) * rows * cols
      ref = rowwise_refs[lhs_dtype]
      operands = (lhs[lhs_dtype], rhs_nk, row_scale, col_scale)
      if cfg is not None:
        kernel = (kernels.all_gather_lhs_matmul if lhs_dtype == E4M3 else
                  kernels.matmul_reduce_scatter)
        ours[name] = (kernel, cfg, operands, ref, dict(
            weight_layout="nk", row_scale=row_scale, col_scale=col_scale))
      with jax.set_mesh(mesh):
        run(name, fn, None if cfg is None else dataclasses.asdict(cfg),
            operands, ref)
  if args.fp8_forward:
    operands = fp8_forward_operands(big_m, k, n, dev)
    ref = np.asarray(jax.jit(fp8_forward_reference)(*operands))
    with jax.set_mesh(mesh):
      for name, fn in fp8_forward_arms(big_m, k, n):
        run(name, fn, None, operands, ref)


def trace_ranges(cfg, big_m, n, num_sms):
  """Ranges per warpgroup a traced call needs: the k loop and epilogue of
  each of a block's tiles, and a margin."""
  tiles = math.ceil(big_m / cfg.cta_tile_m) * math.ceil(n / cfg.cta_tile_n)
  return 2 * math.ceil(tiles / num_sms) + 4


def trace(row, name, kernel, cfg, operands, ref, mesh, args, kw):
  """Runs `kernel(*operands, **kw)` once more under `trace_warpgroups`;
  keeps its trace in --trace-dir, its summary in the row, and checks its
  result too."""
  big_m, n = ref.shape
  ranges = trace_ranges(cfg, big_m, n, jax.devices()[0].core_count)
  dest = os.path.join(args.trace_dir,
                      f"{row['shape'].replace('/', 'x')}_{name}.json")

  def build():
    return jax.jit(jax.shard_map(
        functools.partial(kernel, axis_name="x", config=cfg, **kw),
        in_specs=(P(), P()), out_specs=P(), check_vma=False))

  try:
    poison(big_m * n * 4)
    out, summary = warpgroup_trace.run_traced(
        build, operands[:2], ranges, dest, mesh=mesh,
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


def arm_names(args):
  """Every arm a run with these arguments times, by its name in the rows
  (what --only selects from)."""
  names = ["cublas", "ours_ag", "ours_rs"] + [
      f"ours_{v}" for v, _ in args.variant if not is_fp8_variant(v)]
  if not args.skip_upstream:
    names += ["upstream_none", "upstream_m", "upstream_n"]
  if not args.skip_fp8:
    names += ["cublas_fp8", "cublas_fp8_rs", "ours_fp8", "ours_fp8_rs"] + [
        f"ours_{v}" for v, _ in args.variant if is_fp8_variant(v)]
    if args.rowwise:
      names += list(ROWWISE_ARMS)
    if args.fp8_forward:
      names += ["xla_fp8_fwd", "ours_fp8_fwd"]
  return names


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
  parser.add_argument("--skip-fp8", action="store_true",
                      help="do not time the fp8 arms (cuBLASLt's fp8 GEMM "
                      "and our kernels' fp8 cores)")
  parser.add_argument("--rowwise", action="store_true",
                      help="also time the fp8 GEMMs scaled by f32 row and "
                      "column vectors: XLA's and our two cores "
                      "(cublas_fp8_rowwise, cublas_fp8_rs_rowwise, "
                      "ours_fp8_rowwise, ours_fp8_rs_rowwise)")
  parser.add_argument("--fp8-forward", action="store_true",
                      help="also time an fp8 layer's forward from bf16 "
                      "operands as Flax runs it (amax, scale, quantization, "
                      "product): XLA's and ours (xla_fp8_fwd, ours_fp8_fwd)")
  parser.add_argument("--trace-warmups", type=int, default=1,
                      help="with --trace-dir: calls run (their traces "
                      "dropped) before the traced one kept")
  parser.add_argument("--trace-dir", default=None,
                      help="also trace each of our configs once (warpgroup "
                      "phases) into this directory")
  parser.add_argument("--power-seconds", type=float, default=0,
                      help="then run every method back to back this long "
                      "while sampling its SM clock and power (nvidia-smi)")
  parser.add_argument("--only", nargs="+", default=None, metavar="ARM",
                      help="time only these arms (their names in the rows: "
                      "cublas, ours_ag, cublas_fp8, ours_fp8_rs, ours_NAME "
                      "of a --variant, ...)")
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
  if args.fp8_forward and args.skip_fp8:
    parser.error("--fp8-forward times fp8 arms: drop --skip-fp8")
  if args.rowwise and args.skip_fp8:
    parser.error("--rowwise times fp8 arms: drop --skip-fp8")
  unknown = set(args.only or ()) - set(arm_names(args))
  if unknown:
    parser.error(f"--only {' '.join(sorted(unknown))}: no such arm (the "
                 f"arms: {' '.join(arm_names(args))})")
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
  names = ["ours_ag", "ours_rs"] + [f"ours_{v}" for v, _ in args.variant
                                    if not is_fp8_variant(v)]
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
  if not args.skip_fp8:
    print_fp8_table(rows, [f"ours_{v}" for v, _ in args.variant
                           if is_fp8_variant(v)])
    if args.rowwise:
      print_rowwise_table(rows)
    if args.fp8_forward:
      print_fp8_forward_table(rows)


def print_rowwise_table(rows):
  """The rowwise fp8 arms against XLA's rowwise GEMM and against the same
  cores with a per-tensor scale, with geomeans."""
  print_ratios(rows, [("ours_fp8_rowwise", "cublas_fp8_rowwise"),
                      ("ours_fp8_rs_rowwise", "cublas_fp8_rs_rowwise"),
                      ("ours_fp8_rowwise", "ours_fp8"),
                      ("ours_fp8_rs_rowwise", "ours_fp8_rs"),
                      ("cublas_fp8_rowwise", "cublas_fp8")],
               "cublas_fp8_rowwise", "XLA fp8 rowwise us")


def print_fp8_table(rows, variants):
  """The fp8 arms against cuBLASLt's fp8 GEMM and against our bf16 core,
  with geomeans."""
  ratios = [("ours_fp8", "cublas_fp8"), ("ours_fp8_rs", "cublas_fp8"),
            ("ours_fp8_rs", "cublas_fp8_rs"), ("ours_fp8", "ours_ag"),
            ("cublas_fp8", "cublas")] + [(v, "cublas_fp8") for v in variants]
  print_ratios(rows, ratios, "cublas_fp8", "cuBLAS fp8 us")


def print_ratios(rows, ratios, base, base_label):
  """A markdown table of time ratios `x / y` per shape, `base`'s time
  first, with geomeans."""
  print(f"\n| M/K/N | {base_label} | " + " | ".join(
      f"{x} / {y}" for x, y in ratios) + " |")
  print("|---" * (len(ratios) + 2) + "|")
  columns = [[] for _ in ratios]
  for r in rows:
    cells = []
    for (x, y), column in zip(ratios, columns):
      if r.get(x + "_us") and r.get(y + "_us"):
        column.append(r[x + "_us"] / r[y + "_us"])
        cells.append(f"{column[-1]:.3f}")
      else:
        cells.append("-")
    print(f"| {r['shape']} | {r.get(base + '_us', 0):.1f} | "
          + " | ".join(cells) + " |")
  print("| geomean | | " + " | ".join(
      f"{math.exp(statistics.mean(map(math.log, c))):.3f}" if c else "-"
      for c in columns) + " |")


def print_fp8_forward_table(rows):
  """The fp8 forward arms: their times, and each one's time outside its
  longest kernel (the GEMM): the amax, scale and quantization passes, and
  a transpose if it is a pass of its own."""
  arms = ("xla_fp8_fwd", "ours_fp8_fwd")
  print("\n| M/K/N | " + " | ".join(f"{a} us | outside the GEMM us"
                                    for a in arms) + " | ours / xla |")
  print("|---" * (2 * len(arms) + 2) + "|")
  for r in rows:
    if not all(r.get(a + "_us") for a in arms):
      continue
    cells = []
    for a in arms:
      gemm = max(r[a + "_kernels"].values())
      cells += [f"{r[a + '_us']:.1f}", f"{r[a + '_us'] - gemm:.1f}"]
    print(f"| {r['shape']} | " + " | ".join(cells)
          + f" | {r['ours_fp8_fwd_us'] / r['xla_fp8_fwd_us']:.3f} |")


if __name__ == "__main__":
  main()
