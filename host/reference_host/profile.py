"""Where a training step's GPU time goes, read from a JAX profiler trace.

`record` runs steps under `jax.profiler.trace(..., create_perfetto_trace=
True)`; `load_events` reads the Perfetto JSON it writes (or any Chrome-trace
JSON with the same process/thread naming); `breakdown` splits one device's
kernel time per step by class; `compare` states what the collective matmul
hid and what its kernels cost against the GEMMs they replaced.

Classes (by kernel name, and XLA's `hlo_op` where the name is ambiguous):
  collective_matmul  the plugin's Mosaic GPU kernels
  barrier            XLA's cross-device barrier before a collective kernel
  matmul             cuBLAS / cuBLASLt / CUTLASS / Triton GEMMs
  nccl               NCCL collectives
  memcpy             copies and memsets
  compute            every other kernel (fusions, attention, ...)
"""
from __future__ import annotations

import dataclasses
import gzip
import glob
import json
import os
import re
from typing import Any, Iterable, Sequence

CLASSES = ("collective_matmul", "barrier", "matmul", "nccl", "memcpy",
           "compute")
# Kernels that are not communication: overlap with them hides NCCL.
COMPUTE_CLASSES = ("collective_matmul", "matmul", "compute")

# The plugin's kernels: JAX 0.11 names every Mosaic GPU kernel
# "anonymous_mosaic_gpu_kernel"; in these programs the plugin's are the only
# ones (a model with Mosaic GPU attention kernels would need the scope too).
_COLLECTIVE_MATMUL = re.compile(
    r"mosaic_gpu|all_gather_lhs_matmul|matmul_reduce_scatter|"
    r"collective_matmul", re.I)
# XLA's cross-device barrier before a kernel that reaches its peers
# (stream_executor::gpu::MultiGpuBarrierWithNcclKernelImpl on JAX 0.11).
_BARRIER = re.compile(r"barrier", re.I)
_MATMUL = re.compile(
    r"gemm|nvjet|cutlass|xmma|cublas|wgmma|sm90_.*_tn|triton_gemm|"
    r"_gemm_|dot_fusion", re.I)
_NCCL = re.compile(r"nccl", re.I)
_MEMCPY = re.compile(r"memcpy|memset|copy_", re.I)
_HLO_MATMUL = re.compile(r"cublas|gemm|dot", re.I)
_HLO_COLLECTIVE_MATMUL = re.compile(r"mosaic|mpmd_map", re.I)
# Dense projections of MaxText-style models, by their layer names.
PROJECTIONS = ("query", "key", "value", "qkv_proj", "out", "wi_0", "wi_1",
               "wi", "wo", "logits_dense")


@dataclasses.dataclass(frozen=True)
class KernelEvent:
  """One kernel (or copy) on a GPU stream; times in microseconds."""

  name: str
  start_us: float
  duration_us: float
  device: str  # e.g. "/device:GPU:0"
  stream: str
  hlo_op: str = ""
  scope: str = ""  # the op's name scope, e.g. "jit(f)/.../mlp/wi_0/..."

  @property
  def end_us(self) -> float:
    return self.start_us + self.duration_us


def classify(event: KernelEvent) -> str:
  """The event's class (see the module docstring)."""
  name, hlo_op = event.name, event.hlo_op
  if _BARRIER.search(name):
    return "barrier"
  if _NCCL.search(name):
    return "nccl"
  if _COLLECTIVE_MATMUL.search(name):
    return "collective_matmul"
  if _MEMCPY.search(name) and not _MATMUL.search(name):
    return "memcpy"
  if _MATMUL.search(name) or (hlo_op and _HLO_MATMUL.search(hlo_op)
                              and not _HLO_COLLECTIVE_MATMUL.search(hlo_op)):
    return "matmul"
  return "compute"


def _open(path: str):
  with open(path, "rb") as f:
    magic = f.read(2)
  return gzip.open(path, "rt") if magic == b"\x1f\x8b" else open(path)


def load_events(path: str) -> list[KernelEvent]:
  """GPU stream events of a profile: an XSpace (`.xplane.pb`, what
  `jax.profiler.start_trace` always writes, e.g. MaxText's `profiler=xplane`)
  or a Chrome/Perfetto trace JSON (`.json[.gz]`).

  Only threads named like CUDA streams ("Stream #N...") on processes named
  after a GPU ("/device:GPU:N...") count: the trace also holds derived lines
  ("XLA Ops", "XLA Modules", "Steps") that repeat the same time.
  """
  if path.endswith(".pb"):
    return load_xspace_events(path)
  with _open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  process_names, thread_names = {}, {}
  for e in events:
    if e.get("ph") != "M":
      continue
    if e.get("name") == "process_name":
      process_names[e["pid"]] = e.get("args", {}).get("name", "")
    elif e.get("name") == "thread_name":
      thread_names[(e["pid"], e.get("tid"))] = e.get("args", {}).get(
          "name", "")
  out = []
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    device = process_names.get(e.get("pid"), "")
    stream = thread_names.get((e.get("pid"), e.get("tid")), "")
    if not _is_gpu(device) or not _is_stream(stream):
      continue
    args = e.get("args") or {}
    out.append(KernelEvent(
        name=e.get("name", ""), start_us=float(e["ts"]),
        duration_us=float(e["dur"]), device=_device_name(device),
        stream=stream, hlo_op=str(args.get("hlo_op", "")),
        scope=str(args.get("name", ""))))
  return out


def load_xspace_events(path_or_profile) -> list[KernelEvent]:
  """`load_events` for an XSpace: a `.xplane.pb` path or a
  `jax.profiler.ProfileData`. Planes named after a GPU, lines named after
  a CUDA stream, as in the JSON."""
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  profile = (ProfileData.from_file(path_or_profile)
             if isinstance(path_or_profile, str) else path_or_profile)
  out = []
  for plane in profile.planes:
    if not _is_gpu(plane.name):
      continue
    for line in plane.lines:
      if not _is_stream(line.name):
        continue
      for e in line.events:
        stats = dict(e.stats)
        out.append(KernelEvent(
            name=e.name, start_us=e.start_ns * 1e-3,
            duration_us=e.duration_ns * 1e-3,
            device=_device_name(plane.name), stream=line.name,
            hlo_op=str(stats.get("hlo_op", "")),
            scope=str(stats.get("name", ""))))
  return out


def _is_gpu(process_name: str) -> bool:
  return bool(re.search(r"/device:GPU:\d+", process_name))


def _device_name(process_name: str) -> str:
  return re.search(r"/device:GPU:\d+", process_name).group(0)


def _is_stream(thread_name: str) -> bool:
  return thread_name.startswith("Stream #") or thread_name.startswith(
      "Stream ")


def write_device_trace(src: str, dst: str) -> None:
  """Copies a trace's GPU processes only, each event's args cut to the two
  this module reads: a trace small enough to keep with a report (or as a
  test fixture) that gives the same breakdown."""
  with _open(src) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get(
      "name") == "process_name" and _is_gpu(e.get("args", {}).get("name", ""))}
  kept = []
  for e in events:
    if e.get("pid") not in gpu:
      continue
    if e.get("ph") == "X":
      e = dict(e, args={k: v for k, v in (e.get("args") or {}).items()
                        if k in ("hlo_op", "name")})
    kept.append(e)
  with gzip.open(dst, "wt") as f:
    json.dump({"traceEvents": kept}, f, separators=(",", ":"))


def find_trace(log_dir: str, pattern: str = "perfetto_trace.json.gz") -> str:
  """The newest trace file named `pattern` (a glob) that a profiler run
  wrote anywhere under `log_dir` (`.../plugins/profile/<time>/`)."""
  found = sorted(glob.glob(os.path.join(
      log_dir, "**", "plugins", "profile", "*", pattern), recursive=True),
                 key=lambda p: os.path.basename(os.path.dirname(p)))
  if not found:
    raise FileNotFoundError(
        f"no plugins/profile/*/{pattern} under {log_dir}")
  return found[-1]


def _union(intervals: Iterable[tuple[float, float]]
           ) -> list[tuple[float, float]]:
  merged: list[list[float]] = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return [(s, e) for s, e in merged]


def _length(intervals: Sequence[tuple[float, float]]) -> float:
  return sum(e - s for s, e in intervals)


def _minus(a: Sequence[tuple[float, float]],
           b: Sequence[tuple[float, float]]) -> float:
  """Length of union `a` not covered by union `b` (both merged, sorted)."""
  total, j = 0.0, 0
  for start, end in a:
    cursor = start
    while j < len(b) and b[j][1] <= cursor:
      j += 1
    k = j
    while k < len(b) and b[k][0] < end:
      if b[k][0] > cursor:
        total += b[k][0] - cursor
      cursor = max(cursor, b[k][1])
      if cursor >= end:
        break
      k += 1
    if cursor < end:
      total += end - cursor
  return total


def projection_of(scope: str) -> str:
  """'wi_0 backward' for ".../transpose(jvp(...))/layers_1/mlp/wi_0/...":
  the dense layer (or "wi_0+wi_1", a group of siblings) an op belongs to,
  and whether it is in the backward pass (JAX names the transposed
  computation `transpose(...)`); "" when the scope names no projection."""
  direction = "backward" if "transpose(" in scope else "forward"
  for part in reversed(scope.split("/")):
    # A group of siblings in one kernel is scoped "query+key+value".
    if part in PROJECTIONS or (
        "+" in part and all(p in PROJECTIONS for p in part.split("+"))):
      return f"{part} {direction}"
  return ""


@dataclasses.dataclass(frozen=True)
class Breakdown:
  """One device's kernel time per step, in milliseconds."""

  device: str
  steps: int
  busy_ms: float  # union of all its kernels
  class_ms: dict[str, float]  # summed kernel time per class
  nccl_exposed_ms: float  # NCCL time overlapped by no compute kernel
  top_kernels: list[dict[str, Any]]  # name, class, ms per step, count
  # Per hlo_op: ms per step, the part no compute overlaps, count, scope.
  nccl_ops: list[dict[str, Any]]
  # "wi_0 forward" -> {class: ms per step}, for the classes a projection's
  # ops fall in (matmul, collective_matmul, barrier, nccl).
  projections: dict[str, dict[str, float]] = dataclasses.field(
      default_factory=dict)

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def breakdown(events: Sequence[KernelEvent], steps: int,
              device: str | None = None, top: int = 12) -> Breakdown:
  """Kernel time per step of `device` (default: the lowest-numbered GPU)."""
  if steps < 1:
    raise ValueError(f"steps={steps} must be >= 1")
  devices = sorted({e.device for e in events},
                   key=lambda d: int(d.rsplit(":", 1)[1]))
  if not devices:
    raise ValueError("the trace has no GPU stream events")
  device = device or devices[0]
  mine = [e for e in events if e.device == device]
  if not mine:
    raise ValueError(f"no events on {device}; devices: {devices}")
  per = 1e-3 / steps
  classes = [classify(e) for e in mine]
  class_us = {c: 0.0 for c in CLASSES}
  by_kernel: dict[str, list[Any]] = {}
  nccl_by_op: dict[str, list[Any]] = {}
  projections: dict[str, dict[str, float]] = {}
  for e, cls in zip(mine, classes):
    class_us[cls] += e.duration_us
    projection = projection_of(e.scope)
    if projection and cls in ("matmul", "collective_matmul", "barrier",
                              "nccl"):
      mine_cls = projections.setdefault(projection, {})
      mine_cls[cls] = mine_cls.get(cls, 0.0) + e.duration_us * per
    entry = by_kernel.setdefault(e.name, [0.0, 0, cls])
    entry[0] += e.duration_us
    entry[1] += 1
    if cls == "nccl":
      op = nccl_by_op.setdefault(e.hlo_op or e.name, [0.0, 0, e.scope, []])
      op[0] += e.duration_us
      op[1] += 1
      op[3].append((e.start_us, e.end_us))
  busy = _union((e.start_us, e.end_us) for e in mine)
  compute = _union((e.start_us, e.end_us) for e, cls in zip(mine, classes)
                   if cls in COMPUTE_CLASSES)
  nccl = _union((e.start_us, e.end_us) for e, cls in zip(mine, classes)
                if cls == "nccl")
  top_kernels = [
      {"name": name, "class": cls, "ms_per_step": us * per,
       "count_per_step": count / steps}
      for name, (us, count, cls) in sorted(by_kernel.items(),
                                           key=lambda kv: -kv[1][0])[:top]]
  nccl_ops = [{"op": op, "ms_per_step": us * per,
               "exposed_ms_per_step": _minus(_union(spans), compute) * per,
               "count_per_step": count / steps, "scope": scope}
              for op, (us, count, scope, spans) in sorted(
                  nccl_by_op.items(), key=lambda kv: -kv[1][0])]
  return Breakdown(
      device=device, steps=steps, busy_ms=_length(busy) * per,
      class_ms={c: v * per for c, v in class_us.items()},
      nccl_exposed_ms=_minus(nccl, compute) * per,
      top_kernels=top_kernels, nccl_ops=nccl_ops,
      projections=dict(sorted(projections.items())))


@dataclasses.dataclass(frozen=True)
class Comparison:
  """What the collective arm hid and paid, per step (ms)."""

  baseline_exposed_ms: float
  collective_exposed_ms: float
  hidden_ms: float
  hidden_fraction: float | None
  replaced_gemm_ms: float  # baseline GEMM time the rewrite removed
  collective_kernel_ms: float  # the plugin's kernels + their barriers
  baseline_busy_ms: float
  collective_busy_ms: float

  @property
  def kernel_overhead_ms(self) -> float:
    return self.collective_kernel_ms - self.replaced_gemm_ms

  @property
  def ceiling_fraction(self) -> float:
    """Step time saved if every exposed NCCL ms were hidden for free."""
    return self.baseline_exposed_ms / max(self.baseline_busy_ms, 1e-9)

  def sentence(self) -> str:
    pct = ("" if self.hidden_fraction is None
           else f" ({100 * self.hidden_fraction:.0f} %)")
    if self.collective_kernel_ms <= 0:  # An arm with no kernel of ours.
      return (
          f"baseline exposes {self.baseline_exposed_ms:.2f} ms of NCCL per "
          f"step; this arm runs no collective matmul kernel and exposes "
          f"{self.collective_exposed_ms:.2f} ms ({self.hidden_ms:+.2f} ms "
          f"less{pct}); GPU busy {self.baseline_busy_ms:.2f} -> "
          f"{self.collective_busy_ms:.2f} ms per step.")
    return (
        f"baseline exposes {self.baseline_exposed_ms:.2f} ms of NCCL per "
        f"step; the collective arm hides {self.hidden_ms:.2f} ms{pct} "
        f"({self.collective_exposed_ms:.2f} ms still exposed); the rewritten "
        f"GEMMs cost {self.collective_kernel_ms:.2f} ms as collective "
        f"kernels (barriers included) vs {self.replaced_gemm_ms:.2f} ms in "
        f"the baseline ({self.kernel_overhead_ms:+.2f} ms). Ceiling at this "
        f"layout: {self.baseline_exposed_ms:.2f} ms "
        f"({100 * self.ceiling_fraction:.1f} % of the baseline's busy "
        "time), reached with all of it hidden and kernels as fast as cuBLAS.")

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out.update(kernel_overhead_ms=self.kernel_overhead_ms,
               ceiling_fraction=self.ceiling_fraction,
               sentence=self.sentence())
    return out


def compare(baseline: Breakdown, collective: Breakdown) -> Comparison:
  """The GEMMs the rewrite replaced are the baseline's matmul time less the
  matmul time the collective arm still runs (the same remaining GEMMs)."""
  hidden = baseline.nccl_exposed_ms - collective.nccl_exposed_ms
  return Comparison(
      baseline_exposed_ms=baseline.nccl_exposed_ms,
      collective_exposed_ms=collective.nccl_exposed_ms,
      hidden_ms=hidden,
      hidden_fraction=(hidden / baseline.nccl_exposed_ms
                       if baseline.nccl_exposed_ms > 0 else None),
      replaced_gemm_ms=(baseline.class_ms["matmul"]
                        - collective.class_ms["matmul"]),
      collective_kernel_ms=(collective.class_ms["collective_matmul"]
                            + collective.class_ms["barrier"]
                            - baseline.class_ms["barrier"]),
      baseline_busy_ms=baseline.busy_ms,
      collective_busy_ms=collective.busy_ms)


_COLLECTIVE_HLO = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s"
    r"(?P<op>all-gather-start|all-gather|reduce-scatter|all-reduce-start|"
    r"all-reduce|all-to-all|collective-permute-start|collective-permute)\(",
    re.M)
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def _shape_bytes(shape: str) -> int:
  total = 0
  for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
    size = 1
    for d in filter(None, dims.split(",")):
      size *= int(d)
    total += size * _DTYPE_BYTES.get(dtype, 0)
  return total


def _largest_array_bytes(shape: str) -> int:
  return max((_shape_bytes(s) for s in re.findall(r"\w+\[[\d,]*\]", shape)),
             default=0)


def collectives_in_hlo(hlo_text: str) -> list[dict[str, Any]]:
  """The collectives a compiled program runs: HLO name, op, result shape,
  the bytes of its largest array (per device) and the JAX op it came from."""
  out = []
  for m in _COLLECTIVE_HLO.finditer(hlo_text):
    shape = m.group("shape")
    line_end = hlo_text.find("\n", m.end())
    scope = re.search(r'op_name="([^"]*)"',
                      hlo_text[m.end():line_end if line_end >= 0 else None])
    out.append({"name": m.group("name"), "op": m.group("op"),
                "shape": shape, "bytes": _largest_array_bytes(shape),
                "scope": scope.group(1) if scope else ""})
  return out


def record(run_steps, log_dir: str) -> str:
  """Runs `run_steps()` under the profiler; returns the Perfetto trace."""
  import jax  # pylint: disable=g-import-not-at-top
  with jax.profiler.trace(log_dir, create_perfetto_trace=True):
    run_steps()
  return find_trace(log_dir)


def format_breakdown(name: str, b: Breakdown) -> list[str]:
  cls = b.class_ms
  return [
      f"{name}: busy {b.busy_ms:.2f} ms/step on {b.device} ({b.steps} steps "
      f"profiled): matmul {cls['matmul']:.2f}, collective matmul "
      f"{cls['collective_matmul']:.2f}, barrier {cls['barrier']:.2f}, other "
      f"compute {cls['compute']:.2f}, memcpy {cls['memcpy']:.2f}, NCCL "
      f"{cls['nccl']:.2f} ({b.nccl_exposed_ms:.2f} not overlapped by "
      "compute)"]
