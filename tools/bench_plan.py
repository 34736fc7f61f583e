"""A planned GPU run checked without a GPU (`--plan` of bench_kernels.py,
bench_gemm_core.py and scripts/autotune.py).

Runs on the GPU have spent device time on configs that could not run
(shared memory over the limit, once only with the trace's ranges added)
and on an arm that crashed (bench_gemm_core's upstream arm after a config
helper changed its return value). The kernels raise those errors while
tracing, so a CPU finds them. `check_plan` takes every call a run would
time: our kernels (`Call`) and every other arm, cuBLAS, NCCL + cuBLAS, the
portable ring, upstream's Pallas kernels (`FnCall`, built by the same
function the run times). It traces each on D emulated CPU devices and,
where JAX lowers Mosaic GPU kernels off GPU (>= 0.12: layout inference,
barriers, TMA), lowers it for CUDA too; with trace ranges it also traces
the call under `kernels.trace_warpgroups`, as `--trace-dir` runs it. It
prints one line per call and returns how many failed. Nothing is timed and
no numerics are checked: that needs the GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import types
from typing import Any, Callable, Sequence
from unittest import mock

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# JAX 0.10's Mosaic GPU fails layout inference off GPU for every kernel;
# 0.12 lowers them (tests/kernels/test_kernel_lowering.py).
JAX_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
LOWERS_OFF_GPU = JAX_VERSION >= (0, 12)


DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16}
# Mixed fp8 wgmma operands (e5m2 x e4m3): JAX 0.10's wgmma takes one dtype.
MIXED_FP8_JAX = (0, 11)


def parse_shape(text: str):
  """'m/k/n[:dtype]' (the GPU scripts' --shapes) -> (m, k, n, dtype name,
  bf16 if none); ValueError if malformed or of another dtype."""
  dims, _, dtype = text.partition(":")
  parts = dims.split("/")
  if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
    raise ValueError(f"shape {text!r}: expected m/k/n[:dtype], three "
                     "positive integers (e.g. 1024/4096/4096:bf16)")
  dtype = dtype or "bf16"
  if dtype not in DTYPES:
    raise ValueError(f"dtype {dtype!r} of {text!r}: one of {sorted(DTYPES)}")
  return (*map(int, parts), dtype)


@dataclasses.dataclass(frozen=True)
class Call:
  """One kernel call of a planned run: `kernel(a, b, axis_name="x",
  config=config, **kwargs)` in `shard_map` over D devices, operands of
  `shapes` (global) sharded by `in_specs`, of `dtype` (one for all, or
  one per operand); operands past the first two are passed as the keyword
  arguments `operand_names` (e.g. an fp8 product's `scale`).
  `trace_ranges`: the ranges per warpgroup the run would trace it with
  (None: not traced). `needs_jax`: the oldest JAX (major, minor) that can
  trace it (an older one reports it skipped, not failed)."""
  label: str
  kernel: Callable[..., Any]
  config: Any
  shapes: Sequence[tuple[int, int]]
  in_specs: Sequence[P]
  out_spec: P
  devices: int
  dtype: Any = jnp.bfloat16
  kwargs: dict = dataclasses.field(default_factory=dict)
  trace_ranges: int | None = None
  operand_names: Sequence[str] = ()
  needs_jax: tuple[int, int] | None = None


def ring_call(label: str, pattern: str, config, m: int, k: int, n: int,
              d: int, dtype=jnp.bfloat16, **kw) -> Call:
  """The `Call` of a ring kernel at local sizes m x k x n over D devices,
  with the operands the benchmarks and autotuning give it. `pattern`:
  "all_gather" (shards m x k and k x n) or "reduce_scatter" (m rows after
  the scatter, k the local contraction)."""
  from collective_matmul import kernels  # pylint: disable=g-import-not-at-top
  if pattern == "all_gather":
    return Call(label, kernels.all_gather_lhs_matmul, config,
                [(d * m, k), (k, d * n)], [P("x", None), P(None, "x")],
                P(None, "x"), d, dtype, **kw)
  if pattern == "reduce_scatter":
    return Call(label, kernels.matmul_reduce_scatter, config,
                [(d * m, d * k), (d * k, n)], [P(None, "x"), P("x", None)],
                P("x", None), d, dtype, **kw)
  raise ValueError(f"pattern {pattern!r}: all_gather or reduce_scatter")


def fp8_ring_call(label: str, pattern: str, config, m: int, k: int, n: int,
                  d: int, scales=("scale",), **kw) -> Call:
  """`ring_call` of the fp8 products: the all-gather e4m3 x e4m3, the
  reduce-scatter e5m2 x e4m3 (its wgmma mixes the two from JAX 0.11 on),
  the weight K-major (`[n, k]`), bf16 results, and the scale operands
  `scales` by keyword: the per-tensor `scale` (default), or rowwise
  `row_scale` (each device's rows: the all-gather's shard, the
  reduce-scatter's x) and `col_scale` (its weight's columns)."""
  from collective_matmul import kernels  # pylint: disable=g-import-not-at-top
  e4m3, e5m2, f32 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32
  if pattern not in ("all_gather", "reduce_scatter"):
    raise ValueError(f"pattern {pattern!r}: all_gather or reduce_scatter")
  rows = d * m if pattern == "all_gather" else d * d * m
  operands = dict(scale=((), P()), row_scale=((rows,), P("x")),
                  col_scale=((d * n,), P("x")))
  shapes = [operands[name][0] for name in scales]
  specs = [operands[name][1] for name in scales]
  if pattern == "all_gather":
    return Call(label, kernels.all_gather_lhs_matmul, config,
                [(d * m, k), (d * n, k), *shapes],
                [P("x", None), P("x", None), *specs], P(None, "x"), d,
                (e4m3, e4m3) + (f32,) * len(scales),
                kwargs=dict(weight_layout="nk"), operand_names=scales, **kw)
  return Call(label, kernels.matmul_reduce_scatter, config,
              [(d * m, d * k), (n, d * k), *shapes],
              [P(None, "x"), P(None, "x"), *specs], P("x", None), d,
              (e5m2, e4m3) + (f32,) * len(scales),
              kwargs=dict(weight_layout="nk"), operand_names=scales,
              needs_jax=MIXED_FP8_JAX, **kw)


@dataclasses.dataclass(frozen=True)
class FnCall:
  """Any other arm of a planned run: `fn(*operands)` as the run times it
  (the script's own builder; jitted or not), jitted under a mesh of D CPU
  devices, operands of `shapes` (global) sharded by `in_specs`, of `dtype`
  (one for all, or one per operand). `config` is only printed. `gpu_facts`: modules that read the device's facts
  while tracing (upstream's kernels read the SM count and the device
  count from `jax.devices()`); while the call is checked they see those of
  a host of D GPUs of `num_sms` SMs (`gpu_facts`)."""
  label: str
  fn: Callable[..., Any]
  shapes: Sequence[tuple[int, int]]
  in_specs: Sequence[P]
  devices: int
  dtype: Any = jnp.bfloat16
  config: Any = None
  gpu_facts: Sequence[types.ModuleType] = ()
  num_sms: int = 132
  needs_jax: tuple[int, int] | None = None


class _GpuDevice:
  """A CPU device that reports `core_count` SMs, as a GPU does."""

  def __init__(self, device, num_sms):
    self._device, self.core_count = device, num_sms

  def __getattr__(self, name):
    return getattr(self._device, name)


class _GpuJax(types.ModuleType):
  """`jax` as a module that asks for the devices sees it on a host of the
  mesh's D GPUs: `devices()` of `num_sms` SMs, `device_count()` D, one
  process. Everything else is jax's own."""

  def __init__(self, devices, num_sms):
    super().__init__("jax")
    self._devices = [_GpuDevice(d, num_sms) for d in devices]

  def __getattr__(self, name):
    return getattr(jax, name)

  def devices(self, backend=None):
    del backend
    return list(self._devices)

  def local_devices(self, process_index=None, backend=None):
    del process_index, backend
    return list(self._devices)

  def device_count(self, backend=None):
    del backend
    return len(self._devices)

  local_device_count = device_count

  def process_count(self, backend=None):
    del backend
    return 1


@contextlib.contextmanager
def gpu_facts(modules, mesh, num_sms: int):
  """While active, each module's `jax` (and upstream's `get_num_sms`,
  where the module has one) answers as on a host of the mesh's devices as
  GPUs of `num_sms` SMs, so upstream's kernels trace on CPU as they would
  on that host. Only those modules' globals change."""
  with contextlib.ExitStack() as stack:
    fake = _GpuJax(list(mesh.devices.flat), num_sms)
    for module in modules:
      stack.enter_context(mock.patch.object(module, "jax", fake))
      if hasattr(module, "get_num_sms"):
        stack.enter_context(mock.patch.object(module, "get_num_sms",
                                              lambda: num_sms))
    yield


@dataclasses.dataclass(frozen=True)
class Broken:
  """A call the plan could not even build (e.g. a patched config with a
  field out of range): reported as failed."""
  label: str
  devices: int
  error: str


def planned_device(num_sms: int = 132, devices: int = 8):
  """The machine a plan stands for (an H200 host), as `selection` reads it:
  so the configs a plan checks are those the GPU run will pick, packaged
  table entries included (the CPU's own facts would key them by "cpu")."""
  from collective_matmul import selection  # pylint: disable=g-import-not-at-top
  return selection.DeviceFacts("gpu", "NVIDIA H200", num_sms, 1, devices)


def config_delta(config) -> str:
  """The config's fields that differ from its class's defaults (a config
  that is no dataclass, or has required fields: as it prints)."""
  if config is None:
    return ""
  try:
    default = type(config)()
  except TypeError:
    return str(config)
  return " ".join(f"{f.name}={getattr(config, f.name)}"
                  for f in dataclasses.fields(config)
                  if getattr(config, f.name) != getattr(default, f.name))


def cpu_mesh(d: int):
  """A D-device mesh of CPU devices (the emulated ones)."""
  cpus = jax.devices("cpu")
  if len(cpus) < d:
    raise SystemExit(
        f"--plan {d}: only {len(cpus)} CPU devices; start with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={d} or more")
  return jax.make_mesh((d,), ("x",), devices=cpus[:d],
                       axis_types=(jax.sharding.AxisType.Explicit,))


def _operands(call: Call | FnCall, mesh):
  """The call's operands as abstract values on `mesh`."""
  dtypes = (call.dtype if isinstance(call.dtype, (tuple, list))
            else [call.dtype] * len(call.shapes))
  return [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, spec))
          for s, dtype, spec in zip(call.shapes, dtypes, call.in_specs)]


def _traced(call: Call, mesh):
  args = _operands(call, mesh)

  def fn(a, b, *rest):
    return call.kernel(a, b, axis_name="x", config=call.config,
                       **call.kwargs, **dict(zip(call.operand_names, rest)))

  with jax.set_mesh(mesh):
    return jax.jit(jax.shard_map(fn, in_specs=tuple(call.in_specs),
                                 out_specs=call.out_spec,
                                 check_vma=False)).trace(*args)


def _check_fn_call(call: FnCall) -> str:
  mesh = cpu_mesh(call.devices)
  args = _operands(call, mesh)
  try:
    with jax.set_mesh(mesh), gpu_facts(call.gpu_facts, mesh, call.num_sms):
      traced = jax.jit(call.fn).trace(*args)
      if LOWERS_OFF_GPU:
        traced.lower(lowering_platforms=("cuda",))
  except Exception as e:  # pylint: disable=broad-except
    return f"FAILED {type(e).__name__}: {str(e)[:400]}"
  return "lowered" if LOWERS_OFF_GPU else "traced"


def check_call(call: Call | FnCall | Broken) -> str:
  """'lowered' / 'traced' (what it got to), 'FAILED ...' with the error
  (its stage named where only the traced call fails), or 'skipped ...'
  where this JAX is older than the call `needs_jax`."""
  if isinstance(call, Broken):
    return f"FAILED {call.error}"
  if call.needs_jax is not None and JAX_VERSION < tuple(call.needs_jax):
    return (f"skipped (needs JAX >= {'.'.join(map(str, call.needs_jax))}, "
            f"this is {jax.__version__})")
  if isinstance(call, FnCall):
    return _check_fn_call(call)
  from collective_matmul import kernels  # pylint: disable=g-import-not-at-top
  mesh = cpu_mesh(call.devices)

  def error(e, stage=""):
    return f"FAILED {stage}{type(e).__name__}: {str(e)[:400]}"

  try:
    traced = _traced(call, mesh)
    if LOWERS_OFF_GPU:
      with jax.set_mesh(mesh):
        traced.lower(lowering_platforms=("cuda",))
  except Exception as e:  # pylint: disable=broad-except
    return error(e)
  if call.trace_ranges is not None:
    try:
      with tempfile.TemporaryDirectory() as tmp:
        with kernels.trace_warpgroups(tmp, call.trace_ranges):
          _traced(call, mesh)
    except Exception as e:  # pylint: disable=broad-except
      return error(e, f"under trace_warpgroups ({call.trace_ranges} "
                   "ranges): ")
  return "lowered" if LOWERS_OFF_GPU else "traced"


def check_plan(calls: Sequence[Call | FnCall | Broken],
               print_fn=print) -> int:
  """Checks every call; prints a line each (with the config's fields that
  differ from the defaults) and a summary; returns the number that
  failed."""
  failed = skipped = 0
  how = ("traced and lowered for CUDA" if LOWERS_OFF_GPU else
         f"traced (JAX {jax.__version__} cannot lower Mosaic GPU off GPU; "
         ">= 0.12 can)")
  print_fn(f"plan: {len(calls)} calls, each {how}"
           + (", and traced under trace_warpgroups"
              if any(getattr(c, "trace_ranges", None) is not None
                     for c in calls) else ""))
  for call in calls:
    status = check_call(call)
    failed += status.startswith("FAILED")
    skipped += status.startswith("skipped")
    print_fn(f"  {call.label:<40} D={call.devices} {status}")
    if isinstance(call, Call):
      print_fn(f"      {config_delta(call.config) or '(defaults)'}")
    elif isinstance(call, FnCall) and call.config is not None:
      print_fn(f"      {config_delta(call.config)}")
  print_fn(f"plan: {len(calls) - failed - skipped} ok, {failed} failed"
           + (f", {skipped} skipped (an older JAX)" if skipped else ""))
  return failed
