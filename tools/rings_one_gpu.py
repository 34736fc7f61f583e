"""The rings (D >= 2) checked on one GPU, as D virtual ranks in one launch.

Each case runs one ring kernel (`kernels.*_virtual`, `peers.VirtualRanks`:
the product's kernel and schedule, each peer a slice of stacked arrays, the
SMs split into D shares) on random operands, with the output memory
poisoned (NaN) first, and compares every rank's result with the f32
product of the same values. Cases run in a worker process; a case that
does not finish within `--hang-s` of its launch is a hang, reported as a
failure, and the worker is replaced (a ring that takes two paths hangs
instead of failing).

The cases (`cases()`): every config `selection` picks for the ring at
D = 2, 4 and 8 over the shapes of `tools/bench_gemm_core.py` (rows divided
by D), in bf16, e4m3 x e4m3 (all-gather) and e5m2 x e4m3 (reduce-scatter)
with a scale; each schedule of the kernel tests' configs (chained tiles,
dedicated senders on and off, k-major sends, 64 x 256 warpgroup tiles,
one-slot epilogues) at D = 2 and 4; ping-pong warpgroups (bf16 and fp8,
128 and 192 wide, one-slot epilogues, senders) at D = 2, 4 and 8; shapes
off the tiles in m, n and k; rowwise fp8 (`/rowwise/`: per-row and
per-column f32 scales, random and non-uniform, each rank its own) at
D = 2, 4 and 8, with the picked configs, ping-pong and one-slot tiles,
off the tiles, and a mutation that reads every tile's scales from the
first tile's rows and columns;
skewed ranks (unequal SM shares, one rank held back); and mutations that
drop one wait or one signal of each kernel, which must make the case fail.

  python tools/rings_one_gpu.py --out rings.json          # on a Hopper GPU
  python tools/rings_one_gpu.py --plan [--quick]          # CPU: trace, lower
  python tools/rings_one_gpu.py --list

`--plan` traces every case's program (and lowers it for CUDA on
JAX >= 0.12) without a GPU; CI runs it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import select
import subprocess
import sys
import time

import tool_setup

# The whole GEMMs (rows x k x n) of bench_gemm_core's ten-shape core
# timings (its default six, then llama3-8b's), kept here so that this
# tool's worker does not import the benchmark.
GEMM_SHAPES = ["16384/4096/2048", "16384/4096/6144", "16384/4096/5504",
               "16384/2048/4096", "16384/5504/4096", "2048/4096/4096",
               "16384/4096/7168", "16384/7168/4096", "16384/4096/3072",
               "16384/4096/14336"]
RANKS = (2, 4, 8)
SCALE = 0.75 * 1.25  # bench_gemm_core's fp8 scales' product.
# Rel. error bound per result: bf16 output roundings (and, for the
# reduce-scatter, one per hop of the partial sums; fp8 adds the MMA's
# reduced accumulation precision).
TOLERANCE = 1e-2
SM_COUNT = 132  # H100 and H200 SXM.
DEFAULT_KIND = "NVIDIA H200"


@dataclasses.dataclass(frozen=True)
class Case:
  """One ring run on virtual ranks.

  kind: "all_gather" or "reduce_scatter"; m, k, n: per rank (the
  all-gather's shard rows; the reduce-scatter's rows after the scatter
  and local contraction); dtypes: "bf16" or "fp8"; shares, delay_ns,
  drop: `peers.VirtualRanks`' (shares () for D equal ones); early_free:
  the race that commit de65204 fixed, put back (`_early_free`);
  scales: the scale operands by keyword (`scale`, `row_scale`,
  `col_scale`), None for the default: fp8's per-tensor scale, none for
  bf16; first_tile_scales: every tile's row and column scales read from
  the first tile's (`_first_tile_scales`); expect_fail: a mutation, which
  the check must catch (wrong result or hang).
  """

  name: str
  kind: str
  d: int
  m: int
  k: int
  n: int
  dtypes: str
  config: object
  shares: tuple = ()
  delay_ns: tuple = ()
  drop: frozenset = frozenset()
  early_free: bool = False
  scales: tuple | None = None
  first_tile_scales: bool = False
  expect_fail: bool = False
  origin: str = ""

  def scale_names(self) -> tuple:
    """The scale operands the case passes, by keyword."""
    if self.scales is not None:
      return self.scales
    return ("scale",) if self.dtypes == "fp8" else ()

  def ranks(self):
    from collective_matmul.kernels import peers  # pylint: disable=g-import-not-at-top
    shares = self.shares or (SM_COUNT // self.d,) * self.d
    return peers.VirtualRanks(self.d, tuple(shares), tuple(self.delay_ns),
                              frozenset(self.drop))


def _facts(device_kind):
  from collective_matmul import selection  # pylint: disable=g-import-not-at-top
  return selection.DeviceFacts(platform="gpu", device_kind=device_kind,
                               num_cores=SM_COUNT, local_device_count=8)


def _picked(kind, m, k, n, d, dtypes, facts):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from collective_matmul import selection  # pylint: disable=g-import-not-at-top
  from collective_matmul.enums import Collective  # pylint: disable=g-import-not-at-top
  if dtypes == "bf16":
    lhs, rhs, out = jnp.bfloat16, None, None
  elif kind == "all_gather":
    lhs, rhs, out = jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.bfloat16
  else:
    lhs, rhs, out = jnp.float8_e5m2, jnp.float8_e4m3fn, jnp.bfloat16
  problem = selection.Problem(m, k, n, lhs, d, out, rhs)
  collective = (Collective.ALL_GATHER if kind == "all_gather"
                else Collective.REDUCE_SCATTER)
  return selection.config_for(collective, problem, facts)


def cases(device_kind: str = DEFAULT_KIND, quick: bool = False) -> list[Case]:
  """Every case, most telling first (see the module doc); `quick`: one
  per kind of check."""
  from collective_matmul import kernels  # pylint: disable=g-import-not-at-top
  from collective_matmul.kernels import configs  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
  from cm_test_utils import kernel_configs  # pylint: disable=g-import-not-at-top
  facts = _facts(device_kind)
  out: list[Case] = []
  seen = set()

  def add(case):
    if case.name not in seen:
      seen.add(case.name)
      out.append(case)

  ag, rs = kernels.AllGatherConfig(), kernels.ReduceScatterConfig()
  # 1. The default schedules, then mutations and skew: the harness first
  # shows that it can fail.
  base = dict(m=1024, k=2048, n=1024)
  for kind, config in (("all_gather", ag), ("reduce_scatter", rs)):
    add(Case(f"{kind}/default/d2", kind, 2, dtypes="bf16", config=config,
             origin="default", **base))
  drops = {"all_gather": [("ag_tile_wait", "wait"), ("ag_tile_signal", "signal")],
           "reduce_scatter": [("rs_partial_wait", "wait"),
                              ("rs_partial_signal", "signal")]}
  for kind, config in (("all_gather", ag), ("reduce_scatter", rs)):
    for site, what in drops[kind]:
      # The receiving side runs ahead of its sender (held back 2 ms), so a
      # dropped wait reads a slot that has not landed.
      delay = (0, 2_000_000) if kind == "all_gather" else (2_000_000, 0)
      add(Case(f"{kind}/mutation/drop_{what}", kind, 2, dtypes="bf16",
               config=config, delay_ns=delay, drop=frozenset([site]),
               expect_fail=True, origin="mutation", **base))
  # de65204's race (a pipeline slot freed while a wgmma still reads it),
  # at the 64 x 256 warpgroup tiles it broke; the same configs without it
  # are among the kernel tests' configs below.
  wide = kernel_configs("all_gather")["wide_warpgroup_tiles"]
  wide_rs = kernel_configs("reduce_scatter")["wide_warpgroup_tiles"]
  for kind, config in (("all_gather", wide), ("reduce_scatter", wide_rs)):
    add(Case(f"{kind}/mutation/de65204_race_64x256", kind, 2, dtypes="bf16",
             config=config, early_free=True, expect_fail=True,
             origin="mutation", **base))
    add(Case(f"{kind}/config/wide_warpgroup_tiles/d2/bf16", kind, 2,
             dtypes="bf16", config=config, origin="kernel tests' configs",
             **base))
  for kind, config in (("all_gather", ag), ("reduce_scatter", rs)):
    add(Case(f"{kind}/skew/d2_shares_50_82_delay", kind, 2, dtypes="bf16",
             config=config, shares=(50, 82), delay_ns=(1_000_000, 0),
             origin="skew", **base))
    add(Case(f"{kind}/skew/d4_shares_20_40_33_33", kind, 4, dtypes="bf16",
             config=config, shares=(20, 40, 33, 33),
             delay_ns=(0, 0, 500_000, 0), origin="skew", **base))
  if quick:
    return out
  # 2. What selection picks at D = 2, 4, 8 over the benchmark's shapes.
  for dtypes in ("bf16", "fp8"):
    for d in RANKS:
      for shape in GEMM_SHAPES:
        rows, k, n = (int(x) for x in shape.split("/"))
        m = rows // d
        for kind in ("all_gather", "reduce_scatter"):
          config, source = _picked(kind, m, k, n, d, dtypes, facts)
          # A last column tile partly past n runs other stores: its own case.
          key = (kind, d, dtypes, config, n % config.tile_n == 0)
          if key in seen:
            continue
          seen.add(key)
          add(Case(f"{kind}/picked/d{d}/{dtypes}/{m}x{k}x{n}", kind, d, m, k,
                   n, dtypes, config, origin=f"selection ({source})"))
  # 3. Every schedule of the kernel tests' configs, at D = 2 and 4.
  for kind in ("all_gather", "reduce_scatter"):
    for label, config in kernel_configs(kind).items():
      if configs.axis_reason(config, 2):
        continue  # Clusters and ping-pong: one-device axis only.
      for d in (2, 4):
        for dtypes in ("bf16", "fp8"):
          if dtypes == "fp8" and configs.fp8_reason(
              *_fp8_dtypes(kind), True, config.tile_k):
            continue
          add(Case(f"{kind}/config/{label}/d{d}/{dtypes}", kind, d, 1024, 2048,
                   1024, dtypes, config, origin="kernel tests' configs"))
  # 5. Ping-pong warpgroups in the rings (each tile run whole by one of
  # the two, alternating; its owner sends and announces), 7-8 tiles per
  # block at D = 2 (odd and even counts), D = 2, 4, 8.
  ag_pp, rs_pp = kernels.AllGatherConfig, kernels.ReduceScatterConfig
  pingpong = [
      ("all_gather", "eager", "bf16",
       ag_pp(chain_tiles=True, pingpong=True, eager_release=True)),
      ("all_gather", "senders", "bf16",
       ag_pp(chain_tiles=True, pingpong=True, sender_sms=4)),
      ("all_gather", "192_eager", "fp8",
       ag_pp(tile_k=128, tile_n=192, chain_tiles=True, pingpong=True,
             eager_release=True)),
      ("all_gather", "one_slot_eager", "fp8",
       ag_pp(tile_k=128, chain_tiles=True, pingpong=True, eager_release=True,
             epi_tile_m=128, epi_tile_n=128, epi_slots=1,
             max_concurrent_steps=5)),
      ("all_gather", "192_eager", "bf16",
       ag_pp(tile_n=192, chain_tiles=True, pingpong=True,
             eager_release=True)),
      ("all_gather", "192_senders", "bf16",
       ag_pp(tile_n=192, chain_tiles=True, pingpong=True, sender_sms=4)),
      ("reduce_scatter", "default", "bf16",
       rs_pp(chain_tiles=True, pingpong=True)),
      ("reduce_scatter", "192", "bf16",
       rs_pp(tile_n=192, chain_tiles=True, pingpong=True, send_pieces=1)),
      ("reduce_scatter", "192", "fp8",
       rs_pp(tile_k=128, tile_n=192, chain_tiles=True, pingpong=True)),
      ("reduce_scatter", "one_slot", "fp8",
       rs_pp(tile_k=128, chain_tiles=True, pingpong=True, epi_tile_m=128,
             epi_tile_n=128, epi_slots=1, max_concurrent_steps=5)),
  ]
  for kind, label, dtypes, config in pingpong:
    n = 2304 if config.tile_n == 192 else 2048
    for d in RANKS:
      add(Case(f"{kind}/pingpong/{label}/d{d}/{dtypes}", kind, d, 2048, 1024,
               n, dtypes, config, origin="ping-pong"))
    if config.tile_n == 192:
      # The last column tile partly past n (2176 = 11.3 tiles), as the
      # picks at n = 5504, 7168 and 14336 run it.
      add(Case(f"{kind}/pingpong/{label}/d2/{dtypes}/n2176", kind, 2, 2048,
               1024, 2176, dtypes, config, origin="ping-pong"))
  add(Case("all_gather/pingpong/skew/d2/bf16", "all_gather", 2, 2048, 1024,
           2048, "bf16", pingpong[0][3], shares=(50, 82),
           delay_ns=(1_000_000, 0), origin="ping-pong"))
  add(Case("reduce_scatter/pingpong/skew/d2/bf16", "reduce_scatter", 2, 2048,
           1024, 2048, "bf16", pingpong[6][3], shares=(50, 82),
           delay_ns=(0, 1_000_000), origin="ping-pong"))
  for kind, config, site in (("all_gather", pingpong[0][3], "ag_tile_wait"),
                             ("reduce_scatter", pingpong[6][3],
                              "rs_partial_wait")):
    add(Case(f"{kind}/pingpong/mutation/drop_wait", kind, 2, 2048, 1024,
             2048, "bf16", config, drop=frozenset([site]),
             delay_ns=(0, 2_000_000) if kind == "all_gather"
             else (2_000_000, 0), expect_fail=True, origin="mutation"))
  # 4. Off the tiles in m, n and k (n padded), and n off the tiles left
  # to TMA (1088: a whole number of 64-column swizzle tiles), D = 2 and 8.
  for kind in ("all_gather", "reduce_scatter"):
    for d in (2, 8):
      for dtypes in ("bf16", "fp8"):
        config = (kernels.AllGatherConfig if kind == "all_gather"
                  else kernels.ReduceScatterConfig)(
                      tile_k=128 if dtypes == "fp8" else 64)
        for m, k, n in ((1000, 1936, 1064), (1024, 2048, 1088)):
          add(Case(f"{kind}/off_tiles/d{d}/{dtypes}/{m}x{k}x{n}", kind, d, m,
                   k, n, dtypes, config, origin="off the tiles"))
  for case in rowwise_cases(facts):
    add(case)
  return out


ROWWISE = ("row_scale", "col_scale")


def rowwise_cases(facts) -> list[Case]:
  """6. Rowwise fp8: each rank's own row and column scales (`ROWWISE`), in
  each kernel's epilogue before the cast (the reduce-scatter's before
  each partial sum travels): the configs `selection` picks at D = 2, 4, 8
  (the all-gather at wi's shape, the reduce-scatter at wo's), row or
  column scales alone and both beside the per-tensor scale, ping-pong and
  one-slot 64 x 256 tiles, shapes off the tiles, and a mutation."""
  from collective_matmul import kernels  # pylint: disable=g-import-not-at-top
  from cm_test_utils import ONE_SLOT_WIDE  # pylint: disable=g-import-not-at-top
  from cm_test_utils import PINGPONG_ONE_SLOT  # pylint: disable=g-import-not-at-top
  out = []
  shapes = {"all_gather": GEMM_SHAPES[0], "reduce_scatter": GEMM_SHAPES[3]}
  for kind in ("all_gather", "reduce_scatter"):
    rows, k, n = (int(x) for x in shapes[kind].split("/"))
    for d in RANKS:
      config, source = _picked(kind, rows // d, k, n, d, "fp8", facts)
      out.append(Case(f"{kind}/rowwise/picked/d{d}/fp8/{rows // d}x{k}x{n}",
                      kind, d, rows // d, k, n, "fp8", config,
                      scales=ROWWISE, origin=f"rowwise, selection ({source})"))
    config_class = (kernels.AllGatherConfig if kind == "all_gather"
                    else kernels.ReduceScatterConfig)
    base = config_class(tile_k=128)
    for label, scales in (("rows", ("row_scale",)), ("cols", ("col_scale",)),
                          ("rows_cols_scalar", ROWWISE + ("scale",))):
      out.append(Case(f"{kind}/rowwise/{label}/d2/fp8", kind, 2, 1024, 2048,
                      1024, "fp8", base, scales=scales, origin="rowwise"))
    one_slot = dict(tile_k=128, **ONE_SLOT_WIDE)
    pingpong = dict(tile_k=128, **PINGPONG_ONE_SLOT)
    if kind == "all_gather":
      pingpong["eager_release"] = True  # The tiles forward: `axis_reason`.
    for label, fields in (("one_slot_64x256", one_slot),
                          ("pingpong_one_slot", pingpong)):
      for d in (2, 8):
        out.append(Case(f"{kind}/rowwise/{label}/d{d}/fp8", kind, d, 2048,
                        1024, 2048, "fp8", config_class(**fields),
                        scales=ROWWISE, origin="rowwise"))
    for d in (2, 8):
      out.append(Case(f"{kind}/rowwise/off_tiles/d{d}/fp8/1000x1936x1064",
                      kind, d, 1000, 1936, 1064, "fp8", base, scales=ROWWISE,
                      origin="rowwise, off the tiles"))
    out.append(Case(f"{kind}/rowwise/mutation/first_tile_scales", kind, 2,
                    1024, 2048, 1024, "fp8", base, scales=ROWWISE,
                    first_tile_scales=True, expect_fail=True,
                    origin="mutation"))
  return out


def _fp8_dtypes(kind):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  if kind == "all_gather":
    return jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.bfloat16
  return jnp.float8_e5m2, jnp.float8_e4m3fn, jnp.bfloat16


# ----------------------------------------------------------- one case


def _program(case: Case):
  """(jitted fn, operand shapes/dtypes, reference fn) of a case."""
  import functools  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from collective_matmul import kernels  # pylint: disable=g-import-not-at-top
  d, m, k, n = case.d, case.m, case.k, case.n
  fp8 = case.dtypes == "fp8"
  if fp8:
    a_dt, b_dt, _ = _fp8_dtypes(case.kind)
  else:
    a_dt = b_dt = jnp.bfloat16
  layout = "nk" if fp8 else "kn"
  kw = dict(config=case.config)
  if case.kind == "all_gather":
    shapes = [(d, m, k), (d, n, k) if fp8 else (d, k, n)]
    fn = functools.partial(kernels.all_gather_lhs_matmul_virtual,
                           ranks=case.ranks(), weight_layout=layout, **kw)
  else:
    shapes = [(d, d * m, k), (d, n, k) if fp8 else (d, k, n)]
    fn = functools.partial(kernels.matmul_reduce_scatter_virtual,
                           ranks=case.ranks(), weight_layout=layout, **kw)
  names = case.scale_names()
  if names:
    inner = fn
    fn = lambda a, b, *s: inner(a, b, **dict(zip(names, s)))  # pylint: disable=unnecessary-lambda-assignment
    # Each rank's own vectors: its shard's (all-gather) or its x's rows
    # (reduce-scatter), its weight's columns.
    rows = m if case.kind == "all_gather" else d * m
    shapes += [dict(scale=(), row_scale=(d, rows), col_scale=(d, n))[name]
               for name in names]
  dtypes = [a_dt, b_dt] + [jnp.float32] * len(names)
  specs = [jax.ShapeDtypeStruct(s, t) for s, t in zip(shapes, dtypes)]

  def reference(a, b, *scales):
    given = dict(zip(names, scales))
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    if fp8:
      b = jnp.swapaxes(b, 1, 2)  # [D, k, n]
    if "row_scale" in given:
      a = a * given["row_scale"][..., None]  # As scaling the rows after.
    hi = jax.lax.Precision.HIGHEST
    if case.kind == "all_gather":
      full = a.reshape(d * m, k)
      out = jnp.einsum("rk,dkn->drn", full, b, precision=hi)
      if "col_scale" in given:
        out = out * given["col_scale"][:, None, :]
    else:
      if "col_scale" in given:
        b = b * given["col_scale"][:, None, :]
      total = jnp.einsum("drk,dkn->rn", a, b, precision=hi)
      out = total.reshape(d, m, n)
    return out * given["scale"] if "scale" in given else out
  return jax.jit(fn), specs, jax.jit(reference)


def _operands(specs, seed):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from collective_matmul.kernels import configs  # pylint: disable=g-import-not-at-top
  keys = jax.random.split(jax.random.key(seed), len(specs))
  out = []
  for key, spec in zip(keys, specs):
    if spec.shape == ():
      out.append(jnp.float32(SCALE))
      continue
    if spec.dtype == jnp.float32:  # Row or column scales: non-uniform.
      out.append(jax.random.uniform(key, spec.shape, jnp.float32, 0.25, 4.0))
      continue
    x = jax.random.normal(key, spec.shape, jnp.float32)
    if configs.is_fp8(spec.dtype):
      x = x * 2.0  # fp8: use the format's range, not only its subnormals.
    out.append(x.astype(spec.dtype))
  return out


def _poison(nbytes):
  """Leave NaN in freed device memory, so an unwritten output shows up."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  junk = jnp.full((nbytes // 4 + 4096,), jnp.nan)
  junk.block_until_ready()
  del junk
  jax.effects_barrier()


class _early_free:  # pylint: disable=invalid-name
  """Puts back the race commit de65204 fixed, for one case: the pipeline
  frees a slot with one more step's wgmmas in flight than its release
  allows (`plgpu.wgmma_wait(n)` of `kernels.pipeline` as n + 1 where n is
  0), so a wgmma may read a slot the next load overwrites."""

  def __enter__(self):
    from collective_matmul.kernels import pipeline  # pylint: disable=g-import-not-at-top
    self.module, self.real = pipeline, pipeline.plgpu
    real_wait = self.real.wgmma_wait

    class Racy:
      def __getattr__(self, name):
        return getattr(_early_free.real_module, name)

      @staticmethod
      def wgmma_wait(n):
        return real_wait(n + 1 if n == 0 else n)
    _early_free.real_module = self.real
    pipeline.plgpu = Racy()
    return self

  def __exit__(self, *exc):
    self.module.plgpu = self.real


class _first_tile_scales:  # pylint: disable=invalid-name
  """For one case, every tile's epilogue reads the row and column scales
  of the first tile's rows and columns (`ring_skeleton._broadcast_scales`
  at offset 0): the check must find the result wrong."""

  def __enter__(self):
    from collective_matmul.kernels import ring_skeleton  # pylint: disable=g-import-not-at-top
    self.module, self.real = ring_skeleton, ring_skeleton._broadcast_scales  # pylint: disable=protected-access
    real = self.real
    ring_skeleton._broadcast_scales = (  # pylint: disable=protected-access
        lambda ref, first, shape, axis: real(ref, first * 0, shape, axis))
    return self

  def __exit__(self, *exc):
    self.module._broadcast_scales = self.real  # pylint: disable=protected-access


def _mutations(case: Case):
  """The case's mutations (`_early_free`, `_first_tile_scales`), active
  while its program is traced and compiled."""
  import contextlib  # pylint: disable=g-import-not-at-top
  stack = contextlib.ExitStack()
  if case.early_free:
    stack.enter_context(_early_free())
  if case.first_tile_scales:
    stack.enter_context(_first_tile_scales())
  return stack


def run_case(case: Case, announce=lambda phase: None, seed=0) -> dict:
  """Runs one case in this process (on a GPU): compile, then run with the
  output poisoned, then compare (on the device: `check`). `announce(phase)`
  marks the phases (the worker tells the runner, whose hang clock starts
  at "running")."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  fn, specs, reference = _program(case)
  start = time.perf_counter()
  with _mutations(case):
    compiled = fn.lower(*specs).compile()
  compile_s = time.perf_counter() - start
  args = _operands(specs, seed)
  ref = reference(*args)
  out_bytes = ref.size * 2 * 4  # The output and the receive buffers.
  announce("running")
  errors, sums = [], []
  for _ in range(2):  # Twice: a race shows as a result that moves.
    _poison(out_bytes)
    rel, checksum = check(compiled(*args), ref)
    errors.append([float(e) for e in np.asarray(rel)])
    sums.append(int(checksum))
  worst = max(max(e) for e in errors)
  return dict(name=case.name, status="ok" if worst <= TOLERANCE else "wrong",
              rel_error=worst, rank_errors=errors[-1],
              moved=sums[0] != sums[1], compile_s=round(compile_s, 2))


def check(out, ref):
  """(each rank's relative error of `out` [D, ...] against the f32 `ref`,
  inf where `out` holds a non-finite value (an unwritten, poisoned
  element); the sum of `out`'s bits mod 2**32), computed on the device:
  the outputs stay there (copying them out took most of a large case's
  time). The bit sum is exact in any order, so two runs' sums differ only
  where their outputs do."""
  global _check  # pylint: disable=global-statement
  if _check is None:
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    def fn(out, ref):
      axes = tuple(range(1, out.ndim))
      x = out.astype(jnp.float32)
      err = (jnp.sqrt(jnp.sum(jnp.square(x - ref), axis=axes))
             / jnp.sqrt(jnp.sum(jnp.square(ref), axis=axes)))
      finite = jnp.all(jnp.isfinite(x), axis=axes)
      bits = jax.lax.bitcast_convert_type(
          out, jnp.dtype(f"uint{8 * out.dtype.itemsize}"))
      return (jnp.where(finite, err, jnp.inf),
              jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32))
    _check = jax.jit(fn)
  return _check(out, ref)


_check = None


# ----------------------------------------------------------- the runner


class Runner:
  """Runs cases in a worker process, one at a time; a case whose run
  outlasts `hang_s` (after it compiled; `compile_s` before) is a hang: the
  worker is killed and replaced."""

  def __init__(self, hang_s=30.0, compile_s=300.0, worker_cmd=None,
               env=None):
    self.hang_s, self.compile_s = hang_s, compile_s
    self.worker_cmd = worker_cmd or [sys.executable, os.path.abspath(__file__),
                                     "--worker"]
    self.env = dict(os.environ if env is None else env,
                    PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    self.proc = None

  def _start(self):
    self.proc = subprocess.Popen(self.worker_cmd, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True,
                                 env=self.env)
    self._buf = b""

  def close(self):
    if self.proc is not None:
      self.proc.kill()
      self.proc.wait()
      self.proc = None

  def _line(self, deadline):
    """The worker's next "@@ " line; None at the deadline, "" if it died.
    Reads the pipe unbuffered (a buffered reader would hold lines that
    `select` no longer sees)."""
    fd = self.proc.stdout.fileno()
    while True:
      while b"\n" in self._buf:
        line, self._buf = self._buf.split(b"\n", 1)
        text = line.decode(errors="replace")
        if text.startswith("@@ "):
          return text[3:].strip()
      left = deadline - time.monotonic()
      if left <= 0:
        return None
      ready, _, _ = select.select([fd], [], [], left)
      if ready:
        chunk = os.read(fd, 65536)
        if not chunk:
          return ""  # The worker died.
        self._buf += chunk

  def run(self, name: str) -> dict:
    if self.proc is None or self.proc.poll() is not None:
      self._start()
    start = time.monotonic()
    self.proc.stdin.write(name + "\n")
    self.proc.stdin.flush()
    phase, limit = "compiling", self.compile_s
    deadline = start + limit
    while True:
      line = self._line(deadline)
      if line is None or line == "":
        self.close()
        return dict(name=name, status="hang" if line is None else "died",
                    detail=f"no result {limit:.0f} s into {phase}")
      if line == "running":
        phase, limit = "running", self.hang_s
        deadline = time.monotonic() + limit
        continue
      return json.loads(line)


def _worker(device_kind, quick):
  by_name = {c.name: c for c in cases(device_kind, quick)}
  for line in sys.stdin:
    name = line.strip()
    try:
      result = run_case(by_name[name],
                        announce=lambda phase: print("@@ " + phase,
                                                     flush=True))
    except Exception as e:  # pylint: disable=broad-except
      result = dict(name=name, status="error",
                    detail=f"{type(e).__name__}: {str(e)[:2000]}")
    print("@@ " + json.dumps(result), flush=True)


def verdict(case: Case, result: dict) -> bool:
  """Whether a case came out as it must: ok, or for a mutation, caught."""
  if case.expect_fail:
    return result["status"] in ("wrong", "hang")
  return result["status"] == "ok"


# ----------------------------------------------------------- plan (CPU)


def plan(selected, lower: bool) -> list[str]:
  """Traces (and lowers for CUDA) each case's program; returns errors.
  Before JAX 0.11 (one dtype per wgmma) the e5m2 x e4m3 cases are left
  out."""
  import jax  # pylint: disable=g-import-not-at-top
  mixed = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)
  errors = []
  for case in selected:
    if not mixed and case.dtypes == "fp8" and case.kind == "reduce_scatter":
      continue
    fn, specs, _ = _program(case)
    try:
      traced = fn.trace(*specs)
      if lower:
        traced.lower(lowering_platforms=("cuda",))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(f"{case.name}: {type(e).__name__}: {str(e)[:300]}")
  return errors


def passed_before(paths) -> set[tuple[str, str]]:
  """(name, config repr) of every case that passed in these `--out`
  files."""
  passed = set()
  for path in paths:
    with open(path) as f:
      for r in json.load(f)["results"]:
        if r.get("passed"):
          passed.add((r["name"], r["config"]))
  return passed


def _device_kind():
  try:
    return subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
        capture_output=True, text=True, check=True,
        timeout=30).stdout.splitlines()[0].strip()
  except (OSError, subprocess.SubprocessError, IndexError):
    return DEFAULT_KIND


def main(argv=None):
  tool_setup.prepare()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--plan", action="store_true",
                      help="trace every case (and lower it for CUDA on JAX "
                      ">= 0.12) on this machine, without a GPU")
  parser.add_argument("--list", action="store_true", help="list the cases")
  parser.add_argument("--quick", action="store_true",
                      help="only the default, mutation and skew cases")
  parser.add_argument("--only", nargs="*", default=None,
                      help="cases whose names contain one of these")
  parser.add_argument("--skip-passed", nargs="+", default=None,
                      metavar="JSON",
                      help="leave out the cases that passed, with the same "
                      "config, in these earlier --out files (kernels "
                      "unchanged since: what selection changed runs again)")
  parser.add_argument("--start", type=int, default=0,
                      help="skip the first START selected cases (to go on "
                      "where a run's --budget-s stopped)")
  parser.add_argument("--out", help="write every result as JSON here")
  parser.add_argument("--hang-s", type=float, default=30.0,
                      help="a run outlasting this many seconds is a hang")
  parser.add_argument("--budget-s", type=float, default=None,
                      help="stop starting cases after this many seconds")
  parser.add_argument("--device-kind", default=None,
                      help="the GPU selection picks for (default: "
                      "nvidia-smi's, else H200)")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  kind = args.device_kind or (DEFAULT_KIND if args.plan else _device_kind())
  if args.worker:
    _worker(kind, args.quick)
    return 0
  if args.plan:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  selected = cases(kind, args.quick)
  if args.only:
    selected = [c for c in selected if any(s in c.name for s in args.only)]
    if not selected:
      parser.error(f"--only {args.only}: no case matches")
  if args.skip_passed:
    try:
      passed = passed_before(args.skip_passed)
    except (OSError, ValueError, KeyError, TypeError) as e:
      parser.error(f"--skip-passed: not an earlier --out file: "
                   f"{type(e).__name__}: {e}")
    selected = [c for c in selected if (c.name, repr(c.config)) not in passed]
    if not selected:
      print("every selected case passed before (--skip-passed): none to run")
      return 0
  selected = selected[args.start:]
  if args.list:
    for c in selected:
      print(f"{c.name:60s} {c.origin}")
    return 0
  if args.plan:
    import jax  # pylint: disable=g-import-not-at-top
    version = tuple(int(x) for x in jax.__version__.split(".")[:2])
    errors = plan(selected, lower=version >= (0, 12))
    print(f"planned {len(selected)} cases "
          f"({'traced and lowered' if version >= (0, 12) else 'traced'}), "
          f"{len(errors)} errors")
    for e in errors:
      print("  " + e)
    return 1 if errors else 0
  runner = Runner(hang_s=args.hang_s, env=dict(os.environ, CM_DEVICE_KIND=kind))
  runner.worker_cmd += ["--device-kind", kind] + (["--quick"] if args.quick
                                                  else [])
  results, start = [], time.monotonic()
  try:
    for i, case in enumerate(selected):
      if args.budget_s and time.monotonic() - start > args.budget_s:
        results.append(dict(name=case.name, status="not run",
                            detail="--budget-s spent"))
        continue
      result = runner.run(case.name)
      result.update(d=case.d, dtypes=case.dtypes, origin=case.origin,
                    expect_fail=case.expect_fail, config=repr(case.config),
                    passed=verdict(case, result))
      results.append(result)
      if args.out:  # After every case: a run cut short keeps its results.
        with open(args.out, "w") as f:
          json.dump(dict(device_kind=kind, results=results), f, indent=1)
      print(f"[{i + 1}/{len(selected)}] {time.monotonic() - start:6.0f} s "
            f"{'PASS' if result['passed'] else 'FAIL'} {case.name}: "
            f"{result['status']} {result.get('rel_error', result.get('detail', ''))}",
            flush=True)
  finally:
    runner.close()
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(device_kind=kind, results=results), f, indent=1)
  ran = [r for r in results if r["status"] != "not run"]
  failed = [r for r in ran if not r["passed"]]
  print(f"\n{len(ran)} cases run, {len(ran) - len(failed)} as they must, "
        f"{len(failed)} not, {len(results) - len(ran)} not run")
  for r in failed:
    print(f"  FAIL {r['name']}: {r['status']} "
          f"{r.get('rel_error', r.get('detail', ''))}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
