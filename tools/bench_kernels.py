"""Side-by-side kernel times of all-gather matmuls on the local GPUs.

For each shape (per shard m/k/n) and dtype, one process owning all GPUs:
  bound     D x the local cuBLAS GEMM (XLA dot on one device), CUPTI
  bound_all the same, with every device running its local GEMM at once (no
            communication): the bound under all-GPUs-busy power and clocks
  nccl      all-gather (NCCL) then cuBLAS, in shard_map, CUPTI
  seed      the upstream example kernel (jax.experimental.pallas.ops.gpu.
            collective_matmul_mgpu), best of a small config sweep, CUPTI
  ours      collective_matmul's kernel at its chosen config (and any extra
            configs asked for), CUPTI
  windowed  XLA windowed einsum, in a subprocess with its XLA flags,
            wall-clock pipelined over 200 calls (kernel sums are meaningless
            for multi-stream programs)
A shape `m/k/n:fp8` times the fp8 collective matmuls (the all-gather
e4m3 x e4m3, the reduce-scatter e5m2 x e4m3, the weight K-major, a
per-tensor scale, bf16 results) against XLA's fp8 GEMM alone (bound) and
after its collective (nccl: what MaxText's `quantization=fp8` runs with the
plugin off); no seed or windowed arm (`fp8_arms`).
Kernel time = for each kernel name, the minimum over devices, summed (a
device that waited for its peer does not count its wait); the median over
iterations. With --rounds R every method of a shape is timed R times,
round-robin, and the median over the rounds is reported (`Timer`): long
kernels' times drift between back-to-back readings. Every method's result is checked against an f32 reference,
except a config run in loopback (`"loopback": true` in its --config /
--rs-config JSON: every device sends to itself, the kernel wrapped in
`kernels.diagnostics.loopback`, to time what NVLink costs; WRONG RESULTS by
design).
With --trace-dir DIR each of our kernels also runs under
`kernels.trace_warpgroups` (--trace-warmups calls, then the one whose trace
is kept): per tile, its k loop, epilogue and waits, in SM cycles
(tools/warpgroup_trace.py reads and plots the traces).
With --plan D nothing runs on a GPU: every call the same arguments would
time (the bound's GEMMs, NCCL + cuBLAS, the seed's configs, the picked
configs, each --config / --rs-config, traced too with --trace-dir, and the
ring it checks; not --windowed) is traced on D emulated CPU devices, and lowered for CUDA
where JAX can (>= 0.12), so a config that cannot run fails here, not in
device time (`bench_plan`).

  python tools/bench_kernels.py --out benchmarks/raw.json [--shapes ...]
  python tools/bench_kernels.py --plan 2 --config '{"selected": true, ...}'
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
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

import collective_matmul as cm
from collective_matmul import kernels
from collective_matmul import selection
from collective_matmul.kernels import diagnostics
from collective_matmul.autotuning import kernel_time_us
import bench_plan  # pylint: disable=g-bad-import-order
import warpgroup_trace  # pylint: disable=g-bad-import-order

SHAPES = ["1024/4096/4096:bf16", "1024/4096/4096:f16", "2048/4096/4096:bf16",
          "4096/8192/7168:bf16", "8192/8192/14336:bf16",
          "2048/8192/14336:bf16", "512/4096/4096:bf16"]
DTYPES = bench_plan.DTYPES
# fp8 shapes (`m/k/n:fp8`): the all-gather e4m3 x e4m3, the reduce-scatter
# e5m2 x e4m3 (a gradient times a weight), bf16 results, a per-tensor scale.
FP8 = "fp8"
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_LHS = {"all_gather": E4M3, "reduce_scatter": E5M2}
FP8_SCALE = 0.9375  # The product of two per-tensor scales (0.75 x 1.25).


def parse_shape(text):
  """'m/k/n[:dtype]' -> (m, k, n, dtype name): bench_plan's dtypes, or fp8."""
  dims, _, dtype = text.partition(":")
  if dtype == FP8:
    return (*bench_plan.parse_shape(dims)[:3], FP8)
  return bench_plan.parse_shape(text)
WINDOWED_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0 "
                  "--xla_gpu_multi_streamed_windowed_einsum=true "
                  "--xla_gpu_use_memcpy_local_p2p=true")
WINDOWED_TIMEOUT_S = int(os.environ.get("WINDOWED_TIMEOUT_S", "150"))


class Timer:
  """Times a shape's methods into its row; with --rounds R, every method is
  timed again R - 1 times at the end, round-robin, so a drift of the GPUs'
  clocks over the run falls on all methods alike. `<key>_us` is the median
  over rounds (times `scale`) and `<key>_rounds_us` keeps every round. Each
  method runs under the mesh it is timed with (`mesh`)."""

  def __init__(self, row, args):
    self.row, self.iterations, self.rounds = row, args.iterations, args.rounds
    self.methods = {}

  def time(self, key, f, *operands, mesh, scale=1):
    with jax.set_mesh(mesh):
      out, t, names = kernel_time_us(f, *operands,
                                     iterations=self.iterations)
    self.methods[key] = (f, operands, mesh, scale)
    self.row[f"{key}_rounds_us"] = [scale * t]
    self.row[f"{key}_us"] = scale * t
    return out, scale * t, names

  def finish(self):
    for _ in range(self.rounds - 1):
      for key, (f, operands, mesh, scale) in self.methods.items():
        with jax.set_mesh(mesh):
          _, t, _ = kernel_time_us(f, *operands, iterations=self.iterations)
        self.row[f"{key}_rounds_us"].append(scale * t)
    for key in self.methods:
      self.row[f"{key}_us"] = statistics.median(self.row[f"{key}_rounds_us"])


def trace_ranges(config, m, n, d, num_sms):
  """Ranges per warpgroup a traced call of our kernel needs: its k loop,
  epilogue and a wait per tile, plus a margin."""
  tiles = d * -(-m // config.cta_tile_m) * -(-n // config.cta_tile_n)
  blocks = num_sms - getattr(config, "sender_sms", 0)
  return 3 * -(-tiles // blocks) + 4


def trace_method(row, key, build, operands, config, m, n, mesh, args):
  """With --trace-dir: runs our kernel (`build()` jits it) under
  `kernels.trace_warpgroups` (`warpgroup_trace.run_traced`), keeps the
  trace and puts its summary in the row as `<key>_trace`."""
  if not args.trace_dir:
    return
  ranges = trace_ranges(config, m, n, jax.device_count(),
                        jax.devices()[0].core_count)
  name = f"{row.get('pattern', 'all_gather')}_{row['shape']}_{key}"
  dest = os.path.join(args.trace_dir, name.replace("/", "x") + ".json")
  try:
    _, summary = warpgroup_trace.run_traced(
        build, operands, ranges, dest, mesh=mesh,
        warmup_calls=args.trace_warmups)
  except Exception as e:  # Reported: e.g. no room for the trace.
    row[f"{key}_trace_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"{name} trace failed: {e}", flush=True)
    return
  row[f"{key}_trace"] = summary
  print(f"{name}: {warpgroup_trace.one_line(summary)}", flush=True)


def one_device_mesh():
  """The first device alone (the bound's GEMM runs there)."""
  return jax.make_mesh((1,), ("x",), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Explicit,))


def rel_error(out, ref):
  out = np.asarray(out, np.float32)
  if not np.isfinite(out).all():
    return float("inf")
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def f32_reference(a, b):
  """`a @ b` of the global arrays in f32 (highest precision), computed on
  the GPUs: a host matmul takes minutes at the logits shapes."""
  def product(x, y):
    x = jax.sharding.reshard(x, P()).astype(jnp.float32)
    y = jax.sharding.reshard(y, P()).astype(jnp.float32)
    return jnp.dot(x, y, precision=lax.Precision.HIGHEST)
  return np.asarray(jax.jit(product)(a, b))


def poison_allocator(nbytes):
  """Leave NaN in freed device memory so unwritten outputs show up."""
  for d in jax.local_devices():
    junk = jax.device_put(jnp.full((nbytes // 4 + 1024,), jnp.nan, jnp.float32), d)
    junk.block_until_ready()
    del junk


def windowed_einsum_us(m, k, n, dtype_name, reduce_scatter=False):
  """XLA windowed einsum, timed in a subprocess with its XLA flags."""
  if reduce_scatter:  # x[D*m, D*k] columns sharded, w[D*k, n] rows sharded.
    a_shape, a_spec = f"({m} * d, {k} * d)", 'P(None, "x")'
    b_shape, b_spec = f"({k} * d, {n})", 'P("x", None)'
    out_spec = 'P("x", None)'
  else:
    a_shape, a_spec = f"({m} * d, {k})", 'P("x", None)'
    b_shape, b_spec = f"({k}, {n} * d)", 'P(None, "x")'
    out_spec = 'P(None, "x")'
  code = f"""
import os, time, jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P, NamedSharding
d = jax.device_count()
mesh = jax.make_mesh((d,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
dt = {{"bf16": jnp.bfloat16, "f16": jnp.float16}}["{dtype_name}"]
a = jax.device_put(jax.random.normal(jax.random.key(1), {a_shape}, dt), NamedSharding(mesh, {a_spec}))
b = jax.device_put(jax.random.normal(jax.random.key(2), {b_shape}, dt), NamedSharding(mesh, {b_spec}))
f = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, {out_spec}))
for _ in range(20): f(a, b).block_until_ready()
t = time.perf_counter()
for _ in range(200): r = f(a, b)
r.block_until_ready()
print("US", (time.perf_counter() - t) / 200 * 1e6)
"""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + WINDOWED_FLAGS).strip()
  # This process already holds most of each GPU's memory.
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  try:
    res = subprocess.run([sys.executable, "-c", code], env=env,
                         capture_output=True, text=True,
                         timeout=WINDOWED_TIMEOUT_S)
  except subprocess.TimeoutExpired as e:
    err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr
    print(f"windowed einsum timed out after {WINDOWED_TIMEOUT_S} s:",
          (err or "")[-1500:], flush=True)
    return None
  for line in res.stdout.splitlines():
    if line.startswith("US "):
      return float(line.split()[1])
  print("windowed einsum failed:", res.stderr[-2000:], flush=True)
  return None


def parse_config(config_class, text):
  """(config, loopback) from a --config / --rs-config JSON object.

  "loopback" (or its old name "loopback_for_timing") is not a config field
  but the kernel call's diagnostic switch. With "selected": true the other
  fields replace those of the config `selection` picks for each shape, and
  `config` is a function of that config.
  """
  fields = json.loads(text)
  loopback = bool(fields.pop("loopback", False)
                  | fields.pop("loopback_for_timing", False))
  if fields.pop("selected", False):
    names = {f.name for f in dataclasses.fields(config_class)}
    if not set(fields) <= names:
      raise ValueError(f"{sorted(set(fields) - names)} are no fields of "
                       f"{config_class.__name__}")
    return (lambda picked: dataclasses.replace(picked, **fields)), loopback
  return config_class(**fields), loopback


def resolve_config(cfg, picked):
  """A parsed config (`parse_config`) for a shape whose picked config is
  `picked`: the picked one (None), a fixed one, or the picked one patched."""
  if cfg is None:
    return picked
  return cfg(picked) if callable(cfg) else cfg


def our_configs(parsed, picked):
  """[(key, config, loopback)] a shape times: the picked config as "ours",
  then each parsed --config / --rs-config as "ours_cfgN". A patch that
  does not apply to this shape's pick has its error in place of the
  config."""
  out = []
  for i, (cfg, loopback) in enumerate([(None, False)] + parsed):
    try:
      config = resolve_config(cfg, picked)
    except (TypeError, ValueError) as e:
      config = e
    out.append(("ours" if i == 0 else f"ours_cfg{i}", config, loopback))
  return out


def config_error(row, key, config):
  """Records and prints a config that could not be built; True if so."""
  if not isinstance(config, Exception):
    return False
  row[f"{key}_error"] = f"{type(config).__name__}: {config}"
  print(f"{row['shape']} {key}: {row[key + '_error']}", flush=True)
  return True


def _shmap(fn, out_spec):
  """`fn` per device in shard_map over the mesh in context (axis "x")."""
  return jax.jit(jax.shard_map(fn, out_specs=out_spec, check_vma=False))


# The arms besides ours, built here for the run and its --plan alike.
def bound_matmul():
  """The bound's GEMM: XLA's dot (cuBLAS) on one device."""
  return jax.jit(jnp.dot)


def local_matmuls():
  """Every device's local GEMM at once, no communication (bound_all)."""
  return _shmap(lambda x, y: x @ y, P("x", None))


def nccl_all_gather_matmul():
  """NCCL's all-gather of the rows, then cuBLAS."""
  return _shmap(lambda x, y: lax.all_gather(x, "x", axis=0, tiled=True) @ y,
                P(None, "x"))


def nccl_matmul_reduce_scatter():
  """cuBLAS, then NCCL's reduce-scatter of the rows."""
  return _shmap(lambda x, y: lax.psum_scatter(
      x @ y, "x", scatter_dimension=0, tiled=True), P("x", None))


def ring_all_gather_matmul():
  """The portable ring (collective_matmul, impl="ring"): checked, not
  timed."""
  return _shmap(functools.partial(cm.all_gather_matmul, axis_name="x",
                                  impl="ring"), P(None, "x"))


def seed_matmul(cfg, dtype):
  """Upstream's collective matmul example at `cfg`."""
  from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as seed  # pylint: disable=g-import-not-at-top
  return _shmap(functools.partial(seed.all_gather_lhs_matmul, axis_name="x",
                                  config=cfg, dtype=dtype), P(None, "x"))


def seed_configs():
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  dim = hm.MatmulDimension
  for minor, width, wg in ((dim.M, 4, dim.N), (dim.N, 8, dim.N)):
    yield hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64,
                          max_concurrent_steps=4, grid_minor_dim=minor,
                          grid_tile_width=width, wg_dimension=wg)


def bench_shape(m, k, n, dtype_name, args):
  dtype = DTYPES[dtype_name]
  d = jax.device_count()
  mesh = jax.make_mesh((d,), ("x",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  row = {"shape": f"{m}/{k}/{n}", "dtype": dtype_name, "D": d}
  timer = Timer(row, args)
  flops = 2 * d * m * k * n  # per device
  # Bound: the local GEMM on one device, times D.
  la = jax.device_put(jax.random.normal(jax.random.key(3), (m, k), dtype),
                      jax.devices()[0])
  lb = jax.device_put(jax.random.normal(jax.random.key(4), (k, n), dtype),
                      jax.devices()[0])
  timer.time("bound", bound_matmul(), la, lb, mesh=one_device_mesh(),
             scale=d)
  with jax.set_mesh(mesh):
    a = jax.random.normal(jax.random.key(1), (d * m, k), dtype)
    b = jax.random.normal(jax.random.key(2), (k, d * n), dtype)
    a = jax.sharding.reshard(a, P("x", None))
    b = jax.sharding.reshard(b, P(None, "x"))
    ref = f32_reference(a, b)  # [D*m, D*n]

    def check(name, out):
      err = rel_error(out, ref)
      row[f"{name}_rel_err"] = err
      if not err < 2e-2:
        print(f"!! {name} {m}/{k}/{n} {dtype_name}: rel err {err}", flush=True)
      return err

    def shmap(fn):
      return jax.jit(jax.shard_map(fn, out_specs=P(None, "x"),
                                   check_vma=False))

    # The same local GEMM on every device at once, no communication: the
    # bound under the power and clocks of a run that keeps all GPUs busy.
    timer.time("bound_all", local_matmuls(), a, b, mesh=mesh, scale=d)
    out, _, _ = timer.time("nccl", nccl_all_gather_matmul(), a, b, mesh=mesh)
    check("nccl", out)

    if d > 1 and not args.skip_seed:
      best = None
      for cfg in seed_configs():
        try:
          f = seed_matmul(cfg, dtype)
          poison_allocator(d * m * n * 2)
          out, t, names = kernel_time_us(f, a, b, iterations=args.iterations)
        except Exception as e:  # Configs that do not fit are skipped.
          print(f"seed config {cfg} failed: {str(e)[:200]}", flush=True)
          continue
        if check("seed", out) < 2e-2 and (best is None or t < best[0]):
          best = (t, str(cfg), names, f)
      if best:
        row["seed_us"], row["seed_config"], row["seed_kernels"], f = best
        # The best config takes part in the rounds like the other methods.
        timer.time("seed", f, a, b, mesh=mesh)

    for key, chosen, loopback in our_configs(
        args.config, selection.select_config(m, k, n, dtype, d)):
      if config_error(row, key, chosen):
        continue
      if loopback:  # Diagnostics only: wrong results.
        f = shmap(functools.partial(
            diagnostics.loopback(kernels.all_gather_lhs_matmul),
            axis_name="x", config=chosen))
      else:
        f = shmap(functools.partial(cm.all_gather_matmul, axis_name="x",
                                    impl="pallas", kernel_config=chosen))
      try:
        poison_allocator(d * m * n * 2)
        out, t, names = timer.time(key, f, a, b, mesh=mesh)
      except Exception as e:
        print(f"ours {chosen} failed: {type(e).__name__}: {str(e)[:2000]}",
              flush=True)
        continue
      if loopback:
        row[f"{key}_loopback"] = True
      else:
        check(key, out)
      # A result that changes between runs is a race.
      again = np.asarray(f(a, b), np.float32)
      row[f"{key}_repeat_identical"] = bool(
          np.array_equal(again, np.asarray(out, np.float32)))
      row[f"{key}_config"] = dataclasses.asdict(chosen)
      row[f"{key}_kernels"] = names
      if not loopback:
        trace_method(row, key, lambda chosen=chosen: shmap(functools.partial(
            cm.all_gather_matmul, axis_name="x", impl="pallas",
            kernel_config=chosen)), (a, b), chosen, m, n, mesh, args)

    check("ring", ring_all_gather_matmul()(a, b))
    timer.finish()
  if args.windowed and d > 1:
    row["windowed_us"] = windowed_einsum_us(m, k, n, dtype_name)
  for key in list(row):
    if key.endswith("_us") and isinstance(row[key], float) and row[key]:
      row[key.replace("_us", "_tflops")] = flops / row[key] / 1e6
  return row


def plan_calls(args, d, num_sms=132):
  """Every call the run would time at D devices, in its order, as
  `bench_plan` checks them: the bound's GEMMs, NCCL + cuBLAS, upstream's
  collective matmul (all-gather, D > 1, unless --skip-seed), our kernels
  (`Call`s; H100/H200's `num_sms` for the trace ranges and upstream's
  grid) and the ring the all-gather run checks. Not planned: --windowed,
  XLA's own dot compiled in a subprocess with its flags."""
  calls = []
  for pattern, texts, parsed, select in (
      ("all_gather", args.shapes, args.config, selection.select_config),
      ("reduce_scatter", args.rs_shapes, args.rs_config,
       selection.select_reduce_scatter_config)):
    for text in texts:
      m, k, n, dtype_name = parse_shape(text)
      if dtype_name == FP8:
        calls += plan_fp8_calls(pattern, m, k, n, d, parsed, num_sms)
        continue
      dtype = DTYPES[dtype_name]
      label = f"{pattern} {m}/{k}/{n}:{dtype_name}"
      if pattern == "all_gather":
        ring = dict(shapes=[(d * m, k), (k, d * n)],
                    in_specs=[P("x", None), P(None, "x")], devices=d,
                    dtype=dtype)
        bound = dict(shapes=[(m, k), (k, n)], in_specs=[P(), P()],
                     devices=1, dtype=dtype)
        nccl = nccl_all_gather_matmul
      else:
        ring = dict(shapes=[(d * m, d * k), (d * k, n)],
                    in_specs=[P(None, "x"), P("x", None)], devices=d,
                    dtype=dtype)
        bound = dict(shapes=[(d * m, k), (k, n)], in_specs=[P(), P()],
                     devices=1, dtype=dtype)
        nccl = nccl_matmul_reduce_scatter
      calls += [bench_plan.FnCall(f"{label} bound", bound_matmul(), **bound),
                bench_plan.FnCall(f"{label} bound_all", local_matmuls(),
                                  **ring),
                bench_plan.FnCall(f"{label} nccl", nccl(), **ring)]
      if pattern == "all_gather" and d > 1 and not args.skip_seed:
        from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as seed  # pylint: disable=g-import-not-at-top
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # pylint: disable=g-import-not-at-top
        calls += [bench_plan.FnCall(
            f"{label} seed #{i}", seed_matmul(cfg, dtype), config=cfg,
            gpu_facts=(seed, hm), num_sms=num_sms, **ring)
                  for i, cfg in enumerate(seed_configs())]
      picked = select(m, k, n, dtype, d,
                      device=bench_plan.planned_device(num_sms, d))
      for key, cfg, loopback in our_configs(parsed, picked):
        if isinstance(cfg, Exception):
          calls.append(bench_plan.Broken(f"{label} {key}", d,
                                         f"{type(cfg).__name__}: {cfg}"))
          continue
        call = bench_plan.ring_call(
            f"{label} {key}" + (" (loopback)" if loopback else ""), pattern,
            cfg, m, k, n, d, dtype,
            trace_ranges=trace_ranges(cfg, m, n, d, num_sms)
            if args.trace_dir and not loopback else None)
        if loopback:  # Diagnostics only: wrong results.
          call = dataclasses.replace(
              call, kernel=diagnostics.loopback(call.kernel))
        calls.append(call)
      if pattern == "all_gather":
        calls.append(bench_plan.FnCall(f"{label} ring",
                                       ring_all_gather_matmul(), **ring))
  return calls


def fp8_product(x, w_nk, scale):
  """XLA's fp8 GEMM as Flax's fp8 ops run it: x times the K-major weight
  `[n, k]` to bf16, times the scale (cuBLASLt's fp8 GEMM)."""
  return lax.dot_general(x, w_nk, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.bfloat16) * scale.astype(
                             jnp.bfloat16)


class KernelUnavailable(ValueError):
  """Our kernel does not run for this problem here (`pallas_plan`)."""


def pallas_plan(pattern, problem, device, config):
  """The op's plan that runs our kernel at `config` for `problem` on
  `device` (a plan on CPU stands for GPUs); `KernelUnavailable` where the
  kernel would not run, so a run never times XLA's fallback as ours."""
  plan = selection.choose("pallas", pattern, problem, device, config=config)
  if plan.is_fallback:
    raise KernelUnavailable(f"the kernel does not run here: {plan.reason}")
  return plan


def fp8_arms(pattern, m, k, n, d, parsed, device=None):
  """[(key, fn, config, loopback)] of an fp8 shape, each `fn(x, w_nk,
  scale)` on the global arrays (`fp8_operands`), config None for XLA's:
    bound      the local cuBLASLt fp8 GEMM on one device, as the bf16
               runs count it (`fp8_operands`): D x a shard's for the
               all-gather, the reduce-scatter's local contraction once
    bound_all  every device's local fp8 GEMM at once, no communication
    nccl       XLA's collective of the fp8 operand (all-gather) or of the
               bf16 product (reduce-scatter) and its fp8 GEMM: what
               MaxText's `quantization=fp8` runs with the plugin off
    ours, ours_cfgN  the op with the pallas plan at the fp8 pick and
               each --config / --rs-config (given the weight as `w_nk.T`,
               which the dispatch's transpose folds away), a loopback one
               the kernel itself
    ring       the portable ring (checked, not timed).
  Upstream's example and the windowed einsum take no fp8."""
  bf16 = jnp.bfloat16
  all_gather = pattern == "all_gather"
  device = device or selection.device_facts()
  problem = selection.Problem(m, k, n, FP8_LHS[pattern], d, bf16,
                              None if all_gather else E4M3)
  if all_gather:
    picked = selection.select_config(m, k, n, E4M3, d, device=device,
                                     out_dtype=bf16)
    op, gathered = cm.all_gather_matmul, P(None, "x")
    collective = lambda x, w, s: fp8_product(
        lax.all_gather(x, "x", axis=0, tiled=True), w, s)
    kernel, layout = kernels.all_gather_lhs_matmul, "weight_layout"
  else:
    picked = selection.select_reduce_scatter_config(
        m, k, n, E5M2, d, device=device, out_dtype=bf16, rhs_dtype=E4M3)
    op, gathered = cm.matmul_reduce_scatter, P("x", None)
    collective = lambda x, w, s: lax.psum_scatter(
        fp8_product(x, w, s), "x", scatter_dimension=0, tiled=True)
    kernel, layout = kernels.matmul_reduce_scatter, "weight_layout"
  arms = [("bound", jax.jit(fp8_product), None, False),
          ("bound_all", _shmap(fp8_product, P("x", None)), None, False),
          ("nccl", _shmap(collective, gathered), None, False)]
  for key, config, loopback in our_configs(parsed, picked):
    if isinstance(config, Exception) or loopback:
      fn = None if isinstance(config, Exception) else _shmap(
          lambda x, w, s, config=config: diagnostics.loopback(kernel)(
              x, w, axis_name="x", config=config, scale=s,
              **{layout: "nk"}), gathered)
    else:
      try:
        plan = pallas_plan(pattern, problem, device, config)
        fn = _shmap(lambda x, w, s, plan=plan: op(
            x, w.T, "x", plan=plan, scale=s, preferred_element_type=bf16),
                    gathered)
      except ValueError as e:  # Reported like a config that cannot run.
        config, fn = e, None
    arms.append((key, fn, config, loopback))
  arms.append(("ring", _shmap(lambda x, w, s: op(
      x, w.T, "x", impl="ring", scale=s, preferred_element_type=bf16),
                               gathered), None, False))
  return arms


def fp8_operands(pattern, m, k, n, d):
  """((global shapes, in_specs), the bound's one-device GEMM's shapes and
  how many of it the bound counts, dtypes) of an fp8 shape's (x, w_nk,
  scale): as the bf16 runs, the all-gather's bound D x a shard's `[m, k]`
  times `[n, k]`, the reduce-scatter's one `[D m, k]` times `[n, k]` (its
  local contraction)."""
  dtypes = (FP8_LHS[pattern], E4M3, jnp.float32)
  if pattern == "all_gather":
    ring = ([(d * m, k), (d * n, k), ()], [P("x", None), P("x", None), P()])
    return ring, ([(m, k), (n, k), ()], d), dtypes
  ring = ([(d * m, d * k), (n, d * k), ()], [P(None, "x"), P(None, "x"), P()])
  return ring, ([(d * m, k), (n, k), ()], 1), dtypes


def bench_fp8(pattern, m, k, n, args):
  """An fp8 shape (`fp8_arms`), every result checked against the f32
  product of the same fp8 values times the scale."""
  d = jax.device_count()
  parsed = args.config if pattern == "all_gather" else args.rs_config
  row = {"pattern": pattern, "shape": f"{m}/{k}/{n}", "dtype": FP8, "D": d,
         "dtypes": f"{jnp.dtype(FP8_LHS[pattern]).name} x float8_e4m3fn"}
  timer = Timer(row, args)
  flops = 2 * d * m * k * n
  (shapes, specs), (bound_shapes, bound_count), dtypes = fp8_operands(
      pattern, m, k, n, d)
  key = jax.random.key(5)
  draw = lambda i, shape, dtype: jax.random.normal(
      jax.random.fold_in(key, i), shape, jnp.float32).astype(dtype)
  mesh = jax.make_mesh((d,), ("x",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  scale = jnp.float32(FP8_SCALE)
  arms = fp8_arms(pattern, m, k, n, d, parsed)
  local = [jax.device_put(draw(i, s, t), jax.devices()[0]) for i, (s, t) in
           enumerate(zip(bound_shapes[:2], dtypes))]
  timer.time("bound", arms[0][1], *local, scale, mesh=one_device_mesh(),
             scale=bound_count)
  with jax.set_mesh(mesh):
    x, w_nk = (jax.sharding.reshard(draw(i + 2, s, t), spec) for i, (s, t,
               spec) in enumerate(zip(shapes[:2], dtypes, specs)))
    s = jax.sharding.reshard(scale, P())
    ref = f32_reference(x, jax.sharding.reshard(w_nk, P()).T) * FP8_SCALE
    for key_, fn, config, loopback in arms[1:]:
      if config is not None and config_error(row, key_, config):
        continue
      if key_ == "ring":
        row["ring_rel_err"] = rel_error(fn(x, w_nk, s), ref)
        continue
      try:
        poison_allocator(d * m * d * n * 4)
        out, _, names = timer.time(key_, fn, x, w_nk, s, mesh=mesh)
      except Exception as e:  # pylint: disable=broad-except
        print(f"{pattern} fp8 {key_} failed: {type(e).__name__}: "
              f"{str(e)[:2000]}", flush=True)
        continue
      row[f"{key_}_kernels"] = names
      if loopback:  # Diagnostics only: wrong results.
        row[f"{key_}_loopback"] = True
      elif key_ != "bound_all":
        row[f"{key_}_rel_err"] = err = rel_error(out, ref)
        if not err < 2e-2:
          print(f"!! {pattern} fp8 {key_} {m}/{k}/{n}: rel err {err}",
                flush=True)
      if config is not None:
        row[f"{key_}_config"] = dataclasses.asdict(config)
        again = np.asarray(fn(x, w_nk, s), np.float32)
        row[f"{key_}_repeat_identical"] = bool(
            np.array_equal(again, np.asarray(out, np.float32)))
    timer.finish()
  for name in list(row):
    if name.endswith("_us") and isinstance(row[name], float) and row[name]:
      row[name.replace("_us", "_tflops")] = flops / row[name] / 1e6
  return row


def plan_fp8_calls(pattern, m, k, n, d, parsed, num_sms):
  """`fp8_arms` as `bench_plan` checks them (XLA's arms and the op's
  `FnCall`s; our kernels' fp8 rings lowered through the op)."""
  (shapes, specs), (bound_shapes, _), dtypes = fp8_operands(pattern, m, k,
                                                           n, d)
  label = f"{pattern} {m}/{k}/{n}:{FP8}"
  needs = bench_plan.MIXED_FP8_JAX if pattern == "reduce_scatter" else None
  calls = []
  for key, fn, config, loopback in fp8_arms(
      pattern, m, k, n, d, parsed,
      bench_plan.planned_device(num_sms, d)):
    name = f"{label} {key}" + (" (loopback)" if loopback else "")
    if isinstance(config, KernelUnavailable) and (
        needs is not None and bench_plan.JAX_VERSION < needs):
      config = None  # This JAX's wgmma: reported as skipped, not failed.
    elif isinstance(config, Exception):
      calls.append(bench_plan.Broken(name, d,
                                     f"{type(config).__name__}: {config}"))
      continue
    one = key == "bound"
    calls.append(bench_plan.FnCall(
        name, fn, shapes=bound_shapes if one else shapes,
        in_specs=[P()] * 3 if one else specs, devices=1 if one else d,
        dtype=dtypes, config=config,
        needs_jax=needs if key.startswith("ours") else None))
  return calls


RS_SHAPES = ["1024/4096/4096:bf16", "4096/7168/8192:bf16",
             "8192/14336/8192:bf16"]


def bench_reduce_scatter(m, k, n, dtype_name, args):
  """Matmul + reduce-scatter: per shard m rows after the scatter, k local
  contraction, n output columns."""
  dtype = DTYPES[dtype_name]
  d = jax.device_count()
  row = {"pattern": "reduce_scatter", "shape": f"{m}/{k}/{n}",
         "dtype": dtype_name, "D": d}
  timer = Timer(row, args)
  flops = 2 * d * m * k * n
  la = jax.device_put(jax.random.normal(jax.random.key(3), (d * m, k), dtype),
                      jax.devices()[0])
  lb = jax.device_put(jax.random.normal(jax.random.key(4), (k, n), dtype),
                      jax.devices()[0])
  timer.time("bound", bound_matmul(), la, lb, mesh=one_device_mesh())
  mesh = jax.make_mesh((d,), ("x",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(mesh):
    a = jax.sharding.reshard(jax.random.normal(
        jax.random.key(1), (d * m, d * k), dtype), P(None, "x"))
    b = jax.sharding.reshard(jax.random.normal(
        jax.random.key(2), (d * k, n), dtype), P("x", None))
    ref = f32_reference(a, b)

    def shmap(fn):
      return jax.jit(jax.shard_map(fn, out_specs=P("x", None),
                                   check_vma=False))

    timer.time("bound_all", local_matmuls(), a, b, mesh=mesh)
    out, _, row["nccl_kernels"] = timer.time(
        "nccl", nccl_matmul_reduce_scatter(), a, b, mesh=mesh)
    row["nccl_rel_err"] = rel_error(out, ref)
    for key, chosen, loopback in our_configs(
        args.rs_config, selection.select_reduce_scatter_config(
            m, k, n, dtype, d)):
      if config_error(row, key, chosen):
        continue
      kernel = kernels.matmul_reduce_scatter
      if loopback:  # Diagnostics only: wrong results.
        kernel = diagnostics.loopback(kernel)
      f = shmap(functools.partial(kernel, axis_name="x", config=chosen))
      try:
        poison_allocator(d * m * n * 2)
        out, _, row[f"{key}_kernels"] = timer.time(key, f, a, b, mesh=mesh)
      except Exception as e:
        print(f"ours reduce-scatter {chosen} failed: {type(e).__name__}: "
              f"{str(e)[:3000]}", flush=True)
        continue
      row[f"{key}_config"] = dataclasses.asdict(chosen)
      row[f"{key}_rel_err"] = rel_error(out, ref)
      if loopback:
        row[f"{key}_loopback"] = True
      again = np.asarray(f(a, b), np.float32)
      row[f"{key}_repeat_identical"] = bool(
          np.array_equal(again, np.asarray(out, np.float32)))
      if not loopback:
        trace_method(row, key, lambda chosen=chosen: shmap(functools.partial(
            kernels.matmul_reduce_scatter, axis_name="x", config=chosen)),
            (a, b), chosen, m, n, mesh, args)
    timer.finish()
  if args.windowed and d > 1:
    row["windowed_us"] = windowed_einsum_us(m, k, n, dtype_name,
                                            reduce_scatter=True)
  for key in list(row):
    if key.endswith("_us") and isinstance(row[key], float) and row[key]:
      row[key.replace("_us", "_tflops")] = flops / row[key] / 1e6
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="*", default=SHAPES,
                      help="all-gather shapes m/k/n[:bf16|f16|fp8] (per "
                      "shard)")
  parser.add_argument("--config", action="append", default=[],
                      help="extra kernel config as JSON (repeatable; "
                      '"loopback": true times it in loopback; "selected": '
                      "true: the fields replace those of each shape's "
                      "picked config)")
  parser.add_argument("--skip-seed", action="store_true")
  parser.add_argument("--windowed", action="store_true")
  parser.add_argument("--rs-shapes", nargs="*", default=RS_SHAPES,
                      help="matmul + reduce-scatter shapes (m/k/n per "
                      "shard, [:bf16|f16|fp8])")
  parser.add_argument("--rs-config", action="append", default=[],
                      help="extra reduce-scatter kernel config as JSON "
                      '("loopback": true as for --config)')
  parser.add_argument("--iterations", type=int, default=10,
                      help="timed runs per method (the median is reported)")
  parser.add_argument("--rounds", type=int, default=1,
                      help="time every method this many times, round-robin "
                      "(the median is reported; see Timer)")
  parser.add_argument("--trace-warmups", type=int, default=1,
                      help="with --trace-dir: calls run (their traces "
                      "dropped) before the traced one kept")
  parser.add_argument("--trace-dir", default=None,
                      help="also run each of our kernels once under "
                      "kernels.trace_warpgroups: traces into this directory, "
                      "per-tile figures into the row (<key>_trace)")
  parser.add_argument("--plan", type=int, default=None, metavar="D",
                      help="no GPU: trace (and where JAX can, lower for "
                      "CUDA) every kernel call this run would time, on D "
                      "emulated CPU devices; exit 1 if any fails")
  parser.add_argument("--out", default="benchmarks/raw.json")
  args = parser.parse_args()
  if args.rounds < 1 or args.iterations < 1 or args.trace_warmups < 0:
    parser.error("--rounds and --iterations must be >= 1, --trace-warmups "
                 ">= 0")
  try:
    for text in args.shapes + args.rs_shapes:
      parse_shape(text)
    args.config = [parse_config(kernels.AllGatherConfig, c)
                   for c in args.config]
    args.rs_config = [parse_config(kernels.ReduceScatterConfig, c)
                      for c in args.rs_config]
  except (TypeError, ValueError) as e:  # Bad shapes, JSON or fields.
    parser.error(str(e))
  if args.plan is not None:
    if args.plan < 1:
      parser.error(f"--plan {args.plan}: the devices must be >= 1")
    sys.exit(1 if bench_plan.check_plan(plan_calls(args, args.plan)) else 0)
  if args.trace_dir:
    os.makedirs(args.trace_dir, exist_ok=True)
  rows = []
  versions = {"jax": jax.__version__, "devices": [str(x.device_kind) for x in
                                                  jax.devices()]}
  print(versions, flush=True)
  jobs = [(bench_shape, "all_gather", t) for t in args.shapes] + [
      (bench_reduce_scatter, "reduce_scatter", t) for t in args.rs_shapes]
  for bench, pattern, text in jobs:
    t0 = time.time()
    m, k, n, dtype_name = parse_shape(text)
    row = (bench_fp8(pattern, m, k, n, args) if dtype_name == FP8 else
           bench(m, k, n, dtype_name, args))
    row["wall_s"] = time.time() - t0
    rows.append(row)
    print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump({"versions": versions, "argv": sys.argv, "rows": rows}, f,
                indent=1)
  cols = ["bound", "bound_all", "ours", "seed", "nccl", "windowed"]
  print("\npattern shape            dtype " + " ".join(f"{c:>9}" for c in cols)
        + "  ours/bound")
  for r in rows:
    vals = [r.get(f"{c}_us") for c in cols]
    ratio = (r["ours_us"] / r["bound_us"]) if r.get("ours_us") else None
    print(f"{r.get('pattern', 'all_gather')[:7]:7} {r['shape']:16} {r['dtype']:5} " + " ".join(
        f"{v:9.1f}" if v else f"{'-':>9}" for v in vals)
          + (f"  {ratio:.3f}" if ratio else ""))


if __name__ == "__main__":
  main()
