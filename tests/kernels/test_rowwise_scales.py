"""Row and column scales (rowwise fp8) in both kernels' f32 epilogue, on CPU.

`row_scale` (one f32 per row of the all-gather's local lhs shard, or of
the reduce-scatter's local x) and `col_scale` (one per column of the local
weight) multiply the accumulator, with the per-tensor `scale` where given,
before the cast: `(a @ b) * scale * row[:, None] * col[None, :]`.

- Validated up front, naming the value (every JAX).
- Traced with every JAX, at D = 1 and 2, for the devices' and the virtual
  ranks' entry points; the all-gather's row scales are gathered once,
  before the kernel (`all_gather_matmul_kernel._launch` says why).
- Lowered for CUDA (JAX >= 0.11; CI on 0.12 and on the GPU image's
  0.11.2, whose Mosaic GPU lowers the scale load differently) with row,
  column and both scales, for each kind of schedule: dedicated senders,
  chained tiles, ping-pong warpgroups, one-slot 64 x 256 tiles.
- Interpreted at D = 1 (JAX >= 0.12), fp8 and bf16, against a float64
  reference, outputs poisoned (the interpreter leaves unwritten memory
  NaN), scales random and non-uniform; two mis-indexed epilogues (row
  scales along columns, every tile reading the first tile's scales) fail
  the same check.
The rings (D >= 2) run on a GPU: `tools/rings_one_gpu.py --only /rowwise/`.
"""
import functools
import re

import jax
from jax._src import core as jax_core  # jaxprs_in_params: JAX 0.10 to 0.12.
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul import kernels
from collective_matmul.kernels import configs
from collective_matmul.kernels import peers
from collective_matmul.kernels import ring_skeleton

from cm_test_utils import INTERPRET_TILES as SMALL
from cm_test_utils import ONE_SLOT_WIDE
from cm_test_utils import PINGPONG_ONE_SLOT
from cm_test_utils import INTERPRET_TOLERANCE as TOLERANCE
from cm_test_utils import mesh_1d
from cm_test_utils import needs_interpret_mode
from cm_test_utils import normal

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32 = jnp.float32
AG, RS = kernels.AllGatherConfig, kernels.ReduceScatterConfig
_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
lowers = pytest.mark.skipif(_VERSION < (0, 11),
                            reason="Mosaic GPU lowers off GPU from JAX 0.11 on")
# Which scales a case gives: the row vector, the column vector, both.
SCALES = {"row": ("row_scale",), "col": ("col_scale",),
          "both": ("row_scale", "col_scale")}
# fp8 configs (k steps of 128) of each kind of schedule.
ALL_GATHER = {
    "default": AG(tile_k=128),
    "k_major_senders": AG(tile_k=128, sender_sms=4, k_major_sends=True),
    "by_rows_senders_chained": AG(tile_k=128, sender_sms=4,
                                  chain_tiles=True),
    "one_slot_wide": AG(tile_k=128, **ONE_SLOT_WIDE),
    "pingpong_eager": AG(tile_k=128, pingpong=True, chain_tiles=True,
                         eager_release=True),
    # Ping-pong tiles that forward with a late release: one device only.
    "pingpong_one_slot": AG(tile_k=128, **PINGPONG_ONE_SLOT),
}
REDUCE_SCATTER = {
    "default": RS(tile_k=128),
    "whole_tile_chained": RS(tile_k=128, epi_tile_n=128,
                             max_concurrent_steps=3, send_pieces=2,
                             chain_tiles=True),
    "one_slot_wide_pieces": RS(tile_k=128, send_pieces=4, **ONE_SLOT_WIDE),
    "pingpong_one_slot": RS(tile_k=128, **PINGPONG_ONE_SLOT),
}


def _spec(mesh, shape, spec, dtype):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _program(collective, config, d, scales, m=512, k=1024, n=512,
             lhs_dtype=None, **kw):
  """(fn, abstract operands, mesh) of a kernel's fp8 (or `lhs_dtype`) ring
  over D devices with the scales named in `scales` (`row_scale`,
  `col_scale`, `scale`): the all-gather's lhs shards [m, k] with their
  rows' scales [m], the weight's columns [n, k] with theirs [n]; the
  reduce-scatter's x [D * m, k] per device with its rows' scales
  [D * m], its weight [n, k] with its columns' [n]."""
  mesh = mesh_1d(d)
  fp8 = lhs_dtype is None or configs.is_fp8(lhs_dtype)
  if collective == "all_gather":
    lhs_dtype = lhs_dtype or E4M3
    shapes = {"row_scale": ((d * m,), P("x")), "col_scale": ((d * n,), P("x"))}
    a = _spec(mesh, (d * m, k), P("x", None), lhs_dtype)
    b = (_spec(mesh, (d * n, k), P("x", None), E4M3) if fp8 else
         _spec(mesh, (k, d * n), P(None, "x"), lhs_dtype))
    kernel, out_spec = kernels.all_gather_lhs_matmul, P(None, "x")
  else:
    lhs_dtype = lhs_dtype or E5M2
    shapes = {"row_scale": ((d * d * m,), P("x")),
              "col_scale": ((d * n,), P("x"))}
    a = _spec(mesh, (d * m, d * k), P(None, "x"), lhs_dtype)
    b = (_spec(mesh, (n, d * k), P(None, "x"), E4M3) if fp8 else
         _spec(mesh, (d * k, n), P("x", None), lhs_dtype))
    kernel, out_spec = kernels.matmul_reduce_scatter, P("x", None)
  shapes["scale"] = ((), P())
  names = tuple(scales)
  vectors = [_spec(mesh, *shapes[name], F32) for name in names]
  layout = dict(weight_layout="nk") if fp8 else {}
  fn = jax.shard_map(
      lambda a, b, *v: kernel(a, b, "x", config=config, **layout, **kw,
                              **dict(zip(names, v))),
      out_specs=out_spec, check_vma=False)
  return fn, [a, b, *vectors], mesh


def _mixed_refused_here(collective, lhs_dtype=None):
  return (_VERSION < (0, 11) and collective == "reduce_scatter"
          and (lhs_dtype or E5M2) == E5M2)


# --------------------------------------------------------------- validation


def _refused(collective, match, d=1, **operands):
  """The kernel at D = 1 with these abstract operands replaced raises a
  ValueError matching `match`."""
  names = ("row_scale", "col_scale")
  fn, args, mesh = _program(collective, AG(tile_k=128) if
                            collective == "all_gather" else RS(tile_k=128),
                            d, names, lhs_dtype=E4M3, m=256, k=256, n=256)
  for i, name in enumerate(names):
    if name in operands:
      shape, dtype = operands[name]
      args[2 + i] = _spec(mesh, shape, P(), dtype)
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=match):
      jax.eval_shape(fn, *args)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("name,shape,dtype,match", [
    ("row_scale", (255,), F32,
     r"row_scale of shape \(255,\): expected \(256,\), one float32 scale per "
     r"row of (lhs|x)"),
    ("col_scale", (512,), F32,
     r"col_scale of shape \(512,\): expected \(256,\), one float32 scale per "
     r"column of (rhs|w)"),
    ("row_scale", (256, 1), F32, r"row_scale of shape \(256, 1\)"),
    ("col_scale", (256,), jnp.bfloat16,
     "col_scale of dtype bfloat16: expected float32"),
    ("row_scale", (256,), jnp.float16,
     "row_scale of dtype float16: expected float32"),
])
def test_a_bad_scale_vector_is_refused_naming_it(collective, name, shape,
                                                 dtype, match):
  _refused(collective, match, **{name: (shape, dtype)})


def test_a_scale_vector_with_an_integer_result_is_refused():
  with pytest.raises(ValueError, match=r"row_scale given with an integer "
                     r"result \(out_dtype=int32\)"):
    ring_skeleton.check_vector_scales(jnp.ones(4, F32), None,
                                      out_dtype=jnp.int32)
  with jax.set_mesh(mesh_1d(1)):
    f = jax.shard_map(
        lambda a, b, c: kernels.matmul_reduce_scatter(
            a, b, "x", config=RS(), out_dtype=jnp.int32, col_scale=c),
        in_specs=(P(), P(), P()), out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match="col_scale given with an integer"):
      jax.eval_shape(f, jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
                     jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
                     jax.ShapeDtypeStruct((256,), F32))


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_virtual_ranks_take_one_scale_vector_per_rank(collective):
  ranks = peers.VirtualRanks(2, (66, 66))
  if collective == "all_gather":
    kernel, rows = kernels.all_gather_lhs_matmul_virtual, 256
    x, w = (2, 256, 256), (2, 256, 256)
  else:
    kernel, rows = kernels.matmul_reduce_scatter_virtual, 512
    x, w = (2, 512, 256), (2, 256, 256)
  abstract = lambda shape, dtype=E4M3: jax.ShapeDtypeStruct(shape, dtype)
  config = (AG if collective == "all_gather" else RS)(tile_k=128)
  call = functools.partial(kernel, ranks=ranks, config=config,
                           weight_layout="nk")
  with pytest.raises(ValueError, match=re.escape(
      f"row_scale of shape ({rows},): expected (2, {rows}), one float32 "
      "scale per row of") + ".* of each rank"):
    jax.eval_shape(lambda a, b, r: call(a, b, row_scale=r), abstract(x),
                   abstract(w), abstract((rows,), F32))
  out = jax.eval_shape(
      lambda a, b, r, c: call(a, b, row_scale=r, col_scale=c), abstract(x),
      abstract(w), abstract((2, rows), F32), abstract((2, 256), F32))
  assert out.shape == ((2, 512, 256) if collective == "all_gather" else
                       (2, 256, 256))


# ------------------------------------------------------------------ tracing


@pytest.mark.parametrize("scales", sorted(SCALES))
@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_scaled_kernels_trace_with_the_shapes_they_promise(collective, d,
                                                           scales):
  config = ALL_GATHER["default"] if collective == "all_gather" else (
      REDUCE_SCATTER["default"])
  fn, args, mesh = _program(collective, config, d, SCALES[scales])
  with jax.set_mesh(mesh):
    if _mixed_refused_here(collective):
      with pytest.raises(ValueError, match=r"need JAX >= 0\.11"):
        jax.eval_shape(fn, *args)
      return
    out = jax.eval_shape(fn, *args)
  assert out.shape == ((d * 512, d * 512) if collective == "all_gather" else
                       (d * 512, 512))
  assert out.dtype == jnp.bfloat16


def _all_gathers(jaxpr):
  """(operand shape, dtype) of every all_gather in `jaxpr`, nested ones
  too."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "all_gather":
      found.append((eqn.invars[0].aval.shape, eqn.invars[0].aval.dtype,
                    eqn.outvars[0].aval.shape))
    for sub in jax_core.jaxprs_in_params(eqn.params):
      found += _all_gathers(sub)
  return found


def test_the_all_gather_gathers_the_row_scales_once_before_the_kernel():
  """Each device's row scales [m] are gathered to [D, m] by one all-gather
  outside the kernel; the column scales stay local."""
  fn, args, mesh = _program("all_gather", ALL_GATHER["default"], 2,
                            ("row_scale", "col_scale"))
  with jax.set_mesh(mesh):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  assert _all_gathers(jaxpr) == [((512,), jnp.dtype(F32), (2, 512))]


# ----------------------------------------------------------------- lowering


def _lowered_kernels(fn, args, mesh):
  with jax.set_mesh(mesh):
    text = jax.jit(fn).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
  return len(re.findall(r"custom_call @mosaic_gpu", text))


LOWERED = ([("all_gather", name) for name in sorted(ALL_GATHER)]
           + [("reduce_scatter", name) for name in sorted(REDUCE_SCATTER)])


@lowers
@pytest.mark.parametrize("scales", sorted(SCALES))
@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("collective,name", LOWERED,
                         ids=[f"{c}-{n}" for c, n in LOWERED])
def test_scaled_fp8_kernels_lower_for_cuda(collective, name, d, scales):
  config = (ALL_GATHER if collective == "all_gather" else
            REDUCE_SCATTER)[name]
  reason = configs.axis_reason(config, d)
  fn, args, mesh = _program(collective, config, d, SCALES[scales])
  if reason:
    with jax.set_mesh(mesh), pytest.raises(ValueError,
                                           match=re.escape(reason[:40])):
      jax.eval_shape(fn, *args)
    return
  assert _lowered_kernels(fn, args, mesh) == 1


@lowers
@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("case", ["bf16", "with_scalar", "off_tiles",
                                  "rows_per_batch"])
def test_scaled_kernels_lower_for_cuda_beside_the_other_options(
    case, collective, d):
  """bf16 operands take the scales too; so do the scalar beside them,
  shapes off the tiles (the vectors padded with the operands) and the
  batch-major row order (rows of 256 per batch)."""
  config = (AG if collective == "all_gather" else RS)(
      tile_k=64 if case == "bf16" else 128)
  names = ("row_scale", "col_scale") + (("scale",) if case == "with_scalar"
                                        else ())
  kw = dict(m=200, k=384, n=264) if case == "off_tiles" else {}
  if case == "rows_per_batch":
    kw = dict(rows_per_batch=256)
  fn, args, mesh = _program(collective, config, d, names,
                            lhs_dtype=jnp.bfloat16 if case == "bf16" else None,
                            **kw)
  assert _lowered_kernels(fn, args, mesh) == 1


@lowers
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_virtual_ranks_with_scale_vectors_lower_for_cuda(collective):
  """The one-GPU rings' entry points (tools/rings_one_gpu.py) at D = 4."""
  ranks = peers.VirtualRanks.even(4, 132)
  d, m, k, n = 4, 256, 512, 256
  rows = m if collective == "all_gather" else d * m
  kernel = (kernels.all_gather_lhs_matmul_virtual
            if collective == "all_gather" else
            kernels.matmul_reduce_scatter_virtual)
  config = (AG if collective == "all_gather" else RS)(tile_k=128)
  fn = jax.jit(lambda a, b, r, c: kernel(
      a, b, ranks=ranks, config=config, weight_layout="nk", row_scale=r,
      col_scale=c))
  lhs = E4M3 if collective == "all_gather" else E5M2
  args = [jax.ShapeDtypeStruct((d, rows, k), lhs),
          jax.ShapeDtypeStruct((d, n, k), E4M3),
          jax.ShapeDtypeStruct((d, rows), F32),
          jax.ShapeDtypeStruct((d, n), F32)]
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1


# --------------------------------------------------- Mosaic GPU interpreter

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
interpret_mode = needs_interpret_mode()


def _draw(keys, collective, m, k, n, lhs_dtype, scales):
  """Operands (the weight [n, k] for fp8, else [k, n]) and the named
  scales: vectors uniform in [0.25, 4) (so that a scale read from the
  wrong row or column changes the result), the scalar in [0.5, 2)."""
  fp8 = configs.is_fp8(lhs_dtype)
  a = normal(keys(), (m, k), lhs_dtype)
  b = (normal(keys(), (n, k), E4M3) if fp8 else
       normal(keys(), (k, n), lhs_dtype))
  sizes = {"row_scale": (m,), "col_scale": (n,), "scale": ()}
  bounds = {"scale": (0.5, 2.0)}
  drawn = {name: jax.random.uniform(keys(), sizes[name], F32,
                                    *bounds.get(name, (0.25, 4.0)))
           for name in scales}
  return a, b, drawn


def _interpreted(collective, config, a, b, scales):
  kernel = (kernels.all_gather_lhs_matmul if collective == "all_gather" else
            kernels.matmul_reduce_scatter)
  layout = dict(weight_layout="nk") if configs.is_fp8(a.dtype) else {}
  names = tuple(scales)

  def call():
    with jax.set_mesh(mesh_1d(1)):
      return jax.jit(jax.shard_map(
          lambda a, b, *v: kernel(a, b, "x", config=config, **layout,
                                  **dict(zip(names, v))),
          in_specs=(P(),) * (2 + len(names)), out_specs=P(),
          check_vma=False))(a, b, *scales.values())
  with plgpu.force_gpu_interpret_mode(
      plgpu.InterpretGPUParams(detect_races=True, on_race="raise")):
    return call()


def _reference(a, b, scales):
  """float64 `(a @ b) * scale * row[:, None] * col[None, :]`."""
  a64 = np.asarray(a, np.float64)
  b64 = np.asarray(b, np.float64)
  out = a64 @ (b64.T if configs.is_fp8(b.dtype) else b64)
  if "scale" in scales:
    out = out * float(scales["scale"])
  if "row_scale" in scales:
    out = out * np.asarray(scales["row_scale"], np.float64)[:, None]
  if "col_scale" in scales:
    out = out * np.asarray(scales["col_scale"], np.float64)[None, :]
  return out


def _error(out, ref):
  out = np.asarray(out, np.float64)
  assert np.isfinite(out).all(), "unwritten (NaN) output elements"
  return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _run_and_check(collective, config, m, k, n, lhs_dtype, scales, keys):
  a, b, drawn = _draw(keys, collective, m, k, n, lhs_dtype, scales)
  out = _interpreted(collective, config, a, b, drawn)
  assert out.shape == (m, n) and out.dtype == jnp.bfloat16
  assert _error(out, _reference(a, b, drawn)) < TOLERANCE


INTERPRETED = [("all_gather", E4M3), ("reduce_scatter", E5M2)]


@interpret_mode
@pytest.mark.usefixtures("fresh_interpreter")
@pytest.mark.parametrize("scales", [("row_scale",), ("col_scale",),
                                    ("row_scale", "col_scale", "scale")],
                         ids=["row", "col", "both_and_scalar"])
@pytest.mark.parametrize("collective,lhs_dtype", INTERPRETED,
                         ids=["all_gather_e4m3", "reduce_scatter_e5m2"])
def test_fp8_scales_run_in_interpret_mode(collective, lhs_dtype, scales,
                                          keys):
  """m and n off the tiles (the operands and the vectors padded), 3 k
  steps, 2 x 5 CTA tiles."""
  config = (AG if collective == "all_gather" else RS)(tile_k=128, **SMALL)
  _run_and_check(collective, config, 200, 384, 264, lhs_dtype, scales, keys)


@interpret_mode
@pytest.mark.usefixtures("fresh_interpreter")
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_bf16_operands_take_the_scales_too(collective, keys):
  """The default 128 x 128 warpgroup tiles (split along n: the column
  scales' warpgroup offset), 3 k steps."""
  config = (AG if collective == "all_gather" else RS)()
  _run_and_check(collective, config, 256, 192, 512, jnp.bfloat16,
                 ("row_scale", "col_scale"), keys)


@interpret_mode
@pytest.mark.usefixtures("fresh_interpreter")
@pytest.mark.parametrize("collective,config,m,n", [
    ("all_gather", AG(tile_k=128, **PINGPONG_ONE_SLOT), 384, 640),
    ("reduce_scatter", RS(tile_k=128, **PINGPONG_ONE_SLOT), 384, 640),
    ("all_gather", AG(tile_k=128, **ONE_SLOT_WIDE), 512, 512),
], ids=["all_gather_pingpong_one_slot", "reduce_scatter_pingpong_one_slot",
        "all_gather_one_slot_64x256"])
def test_fp8_scales_with_several_tiles_per_block(collective, config, m, n,
                                                 keys, monkeypatch):
  """2 blocks, so each runs several tiles: ping-pong warpgroups taking
  alternate whole tiles (each tile's scales read by its owner) and the
  one-slot 64 x 256 tiles split along m (the row scales' warpgroup
  offset)."""
  monkeypatch.setattr(configs, "sm_count", lambda device=None: 2)
  _run_and_check(collective, config, m, 384, n, E4M3 if
                 collective == "all_gather" else E5M2,
                 ("row_scale", "col_scale"), keys)


def _rows_along_columns(real):
  """A mis-indexed epilogue: each vector broadcast along the other axis
  (row scales applied per column; the tiles are square)."""
  def broadcast(vector_ref, first, shape, axis):
    return real(vector_ref, first, shape, 1 - axis)
  return broadcast


def _first_tile_only(real):
  """A mis-indexed epilogue: every tile reads the first tile's scales."""
  def broadcast(vector_ref, first, shape, axis):
    return real(vector_ref, first * 0, shape, axis)
  return broadcast


@interpret_mode
@pytest.mark.usefixtures("fresh_interpreter")
@pytest.mark.parametrize("mutation", [_rows_along_columns, _first_tile_only],
                         ids=["rows_along_columns", "first_tile_only"])
def test_a_mis_indexed_scale_fails_the_check(mutation, keys, monkeypatch):
  """The check above catches a scale read from the wrong row or column:
  with the epilogue mis-indexed the error is far above the tolerance."""
  monkeypatch.setattr(ring_skeleton, "_broadcast_scales",
                      mutation(ring_skeleton._broadcast_scales))
  a, b, drawn = _draw(keys, "all_gather", 256, 128, 256, E4M3,
                      ("row_scale", "col_scale"))
  out = _interpreted("all_gather", AG(tile_k=128, **SMALL), a, b, drawn)
  assert _error(out, _reference(a, b, drawn)) > 20 * TOLERANCE
