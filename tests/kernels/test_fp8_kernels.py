"""The fp8 cores of both Hopper kernels on CPU: e4m3 x e4m3 and e5m2 x e4m3,
the weight K-major (`[n, k]`), a per-tensor f32 scale, bf16 results.

- Traced with every JAX (the kernels' Python, validation and shapes), at
  D = 1 and 2. JAX 0.10's wgmma takes one dtype: there the kernels refuse
  e5m2 x e4m3 up front, naming the JAX version.
- Lowered for CUDA at D = 1 and 2 (JAX >= 0.11): the rings cannot run on
  the one GPU lent, so lowering is what checks them before a GPU does.
- Run in Mosaic GPU's interpret mode at D = 1 (JAX >= 0.12, which
  interprets fp8 wgmma), against an f32 product of the same fp8 values.
tests/gpu/test_fp8_kernels_gpu.py checks the numerics on Hopper.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul import kernels

from cm_test_utils import INTERPRET_TILES as SMALL
from cm_test_utils import INTERPRET_TOLERANCE as TOLERANCE
from cm_test_utils import mesh_1d
from cm_test_utils import needs_interpret_mode
from cm_test_utils import normal

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
PAIRS = {"e4m3_e4m3": E4M3, "e5m2_e4m3": E5M2}  # lhs dtype; the weight e4m3.
_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
AG, RS = kernels.AllGatherConfig, kernels.ReduceScatterConfig

ALL_GATHER = {
    "default": AG(tile_k=128),
    "eager_chained": AG(tile_k=128, eager_release=True, chain_tiles=True),
    "offset_chain": AG(tile_k=128, eager_release=True, chain_tiles=True,
                       max_concurrent_steps=3),
    "k_major_senders": AG(tile_k=128, sender_sms=4, k_major_sends=True),
    "by_rows_senders_chained": AG(tile_k=128, sender_sms=4,
                                  chain_tiles=True),
    "wide_one_slot": AG(tile_k=128, tile_m=64, tile_n=256, wg_dimension="m",
                        epi_tile_m=64, epi_tile_n=256, epi_slots=1,
                        max_concurrent_steps=3, chain_tiles=True),
    # The heuristics' fp8 pick beside the by-rows senders at D = 2.
    "wide_one_slot_senders": AG(tile_k=128, tile_m=64, tile_n=256,
                                wg_dimension="m", epi_tile_m=64,
                                epi_tile_n=256, epi_slots=1,
                                max_concurrent_steps=3, chain_tiles=True,
                                sender_sms=4),
}
REDUCE_SCATTER = {
    "default": RS(tile_k=128),
    "whole_tile_chained": RS(tile_k=128, epi_tile_n=128,
                             max_concurrent_steps=3, send_pieces=2,
                             chain_tiles=True),
    "wide_one_slot": RS(tile_k=128, tile_m=64, tile_n=256, wg_dimension="m",
                        epi_tile_m=64, epi_tile_n=256, epi_slots=1,
                        max_concurrent_steps=3, chain_tiles=True),
    # The heuristics' fp8 pick: the partial sum in 4 row pieces.
    "wide_one_slot_pieces": RS(tile_k=128, tile_m=64, tile_n=256,
                               wg_dimension="m", epi_tile_m=64,
                               epi_tile_n=256, epi_slots=1,
                               max_concurrent_steps=3, chain_tiles=True,
                               send_pieces=4),
}


def _mesh(d):
  return jax.make_mesh((d,), ("x",), devices=jax.devices()[:d],
                       axis_types=(jax.sharding.AxisType.Explicit,))


def _all_gather(d, config, lhs_dtype, m=512, k=1024, n=512):
  """(fn, abstract operands, mesh) of the all-gather kernel's fp8 ring:
  lhs shards [m, k], the weight's columns [n, k] per device, the scale."""
  mesh = _mesh(d)
  args = [jax.ShapeDtypeStruct((d * m, k), lhs_dtype,
                               sharding=NamedSharding(mesh, P("x", None))),
          jax.ShapeDtypeStruct((d * n, k), E4M3,
                               sharding=NamedSharding(mesh, P("x", None))),
          jax.ShapeDtypeStruct((), jnp.float32,
                               sharding=NamedSharding(mesh, P()))]
  fn = jax.shard_map(
      lambda a, b, s: kernels.all_gather_lhs_matmul(
          a, b, "x", config=config, weight_layout="nk", scale=s),
      out_specs=P(None, "x"), check_vma=False)
  return fn, args, mesh, (d * m, d * n)


def _reduce_scatter(d, config, lhs_dtype, m=512, k=1024, n=512):
  """The same for the reduce-scatter kernel: x [D * m, k] per device (its
  slice of the contraction), the weight [n, k] (K-major), the scale."""
  mesh = _mesh(d)
  args = [jax.ShapeDtypeStruct((d * m, d * k), lhs_dtype,
                               sharding=NamedSharding(mesh, P(None, "x"))),
          jax.ShapeDtypeStruct((n, d * k), E4M3,
                               sharding=NamedSharding(mesh, P(None, "x"))),
          jax.ShapeDtypeStruct((), jnp.float32,
                               sharding=NamedSharding(mesh, P()))]
  fn = jax.shard_map(
      lambda a, b, s: kernels.matmul_reduce_scatter(
          a, b, "x", config=config, weight_layout="nk", scale=s),
      out_specs=P("x", None), check_vma=False)
  return fn, args, mesh, (d * m, n)


CASES = ([("all_gather", name) for name in sorted(ALL_GATHER)]
         + [("reduce_scatter", name) for name in sorted(REDUCE_SCATTER)])


def _case(kernel, name, d, lhs_dtype):
  if kernel == "all_gather":
    return _all_gather(d, ALL_GATHER[name], lhs_dtype)
  return _reduce_scatter(d, REDUCE_SCATTER[name], lhs_dtype)


def _mixed_refused_here(lhs_dtype):
  return lhs_dtype == E5M2 and _VERSION < (0, 11)


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("kernel,name", CASES)
def test_fp8_kernels_trace_with_the_shapes_they_promise(kernel, name, d,
                                                        pair):
  fn, args, mesh, shape = _case(kernel, name, d, PAIRS[pair])
  with jax.set_mesh(mesh):
    if _mixed_refused_here(PAIRS[pair]):
      with pytest.raises(ValueError, match=r"need JAX >= 0\.11"):
        jax.eval_shape(fn, *args)
      return
    out = jax.eval_shape(fn, *args)
  assert out.shape == shape and out.dtype == jnp.bfloat16


@pytest.mark.skipif(_VERSION < (0, 11),
                    reason="Mosaic GPU lowers off GPU from JAX 0.11 on")
@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("kernel,name", CASES)
def test_fp8_kernels_lower_for_cuda(kernel, name, d, pair):
  fn, args, mesh, _ = _case(kernel, name, d, PAIRS[pair])
  with jax.set_mesh(mesh):
    text = jax.jit(fn).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1


def _abstract(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("lhs,rhs,kw,match", [
    (E4M3, E5M2, {}, "fp8 operands float8_e4m3fn x float8_e5m2"),
    (E4M3, jnp.bfloat16, {}, "fp8 operands float8_e4m3fn x bfloat16"),
    (E4M3, E4M3, dict(weight_layout="kn"), r"weight given \[k, n\]"),
    (E4M3, E4M3, dict(config=AG(tile_k=64)), "tile_k=64 with fp8"),
    (E4M3, E4M3, dict(out_dtype=jnp.float16),
     "preferred_element_type float16 of an fp8 product"),
    (E4M3, E4M3, dict(scale=_abstract((1,), jnp.float32)),
     r"scale of shape \(1,\)"),
    (E4M3, E4M3, dict(scale=_abstract((), jnp.bfloat16)),
     "scale of shape .* and dtype bfloat16"),
    (E4M3, E4M3, dict(weight_layout="kt"), "weight_layout='kt' must be"),
])
def test_fp8_input_is_refused_naming_the_value(lhs, rhs, kw, match):
  kw = dict(dict(config=AG(tile_k=128), weight_layout="nk"), **kw)
  scale = kw.pop("scale", _abstract((), jnp.float32))
  with jax.set_mesh(_mesh(1)):
    f = jax.shard_map(
        lambda a, b, s: kernels.all_gather_lhs_matmul(a, b, "x", scale=s,
                                                      **kw),
        in_specs=(P(), P(), P()), out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match=match):
      rhs_shape = (512, 256) if kw["weight_layout"] == "kn" else (256, 512)
      jax.eval_shape(f, _abstract((256, 512), lhs), _abstract(rhs_shape, rhs),
                     scale)


def test_a_k_major_weight_of_another_contraction_is_refused():
  with jax.set_mesh(_mesh(1)):
    f = jax.shard_map(
        lambda a, b: kernels.matmul_reduce_scatter(
            a, b, "x", config=RS(tile_k=128), weight_layout="nk"),
        in_specs=(P(), P()), out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match=r"w k=384 \(given \[n, k\]\)"):
      jax.eval_shape(f, _abstract((256, 512), E4M3),
                     _abstract((256, 384), E4M3))


# ------------------------------------------------------ Mosaic GPU interpreter

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
interpret_mode = needs_interpret_mode()


def _interpreted(kernel, config, layout, a, b, scale):
  def call():
    with jax.set_mesh(mesh_1d(1)):
      return jax.jit(jax.shard_map(
          lambda a, b, s: kernel(a, b, "x", config=config, scale=s,
                                 **layout),
          in_specs=(P(), P(), P()), out_specs=P(), check_vma=False))(
              a, b, scale)
  with plgpu.force_gpu_interpret_mode(
      plgpu.InterpretGPUParams(detect_races=True, on_race="raise")):
    return call()


@interpret_mode
@pytest.mark.usefixtures("fresh_interpreter")
@pytest.mark.parametrize("kernel,config,layout,lhs_dtype", [
    (kernels.all_gather_lhs_matmul, AG(tile_k=128, **SMALL),
     dict(weight_layout="nk"), E4M3),
    (kernels.matmul_reduce_scatter, RS(tile_k=128, **SMALL),
     dict(weight_layout="nk"), E5M2),
], ids=["all_gather_e4m3", "reduce_scatter_e5m2"])
def test_fp8_core_runs_in_interpret_mode(kernel, config, layout, lhs_dtype,
                                         keys):
  """m and n off the tiles (padded), 3 k steps."""
  m, k, n = 96, 384, 160
  a = normal(keys(), (m, k), lhs_dtype)
  b_nk = normal(keys(), (n, k), E4M3)
  scale = jax.random.uniform(keys(), (), jnp.float32, 0.25, 4.0)
  out = _interpreted(kernel, config, layout, a, b_nk, scale)
  assert out.dtype == jnp.bfloat16
  out = np.asarray(out, np.float32)
  assert np.isfinite(out).all(), "unwritten (NaN) output elements"
  ref = (np.asarray(a, np.float32) @ np.asarray(b_nk, np.float32).T
         * np.float32(scale))
  assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOLERANCE


def _check_interpreted(collective, config, m, k, n, keys):
  """The collective's fp8 core (the all-gather's e4m3 x e4m3, the
  reduce-scatter's e5m2 x e4m3, the weight K-major, a scale) interpreted
  at m x k x n, against the f32 product of the same fp8 values."""
  lhs_dtype = E4M3 if collective == "all_gather" else E5M2
  kernel, layout = ((kernels.all_gather_lhs_matmul, dict(weight_layout="nk"))
                    if collective == "all_gather" else
                    (kernels.matmul_reduce_scatter, dict(weight_layout="nk")))
  a = normal(keys(), (m, k), lhs_dtype)
  b_nk = normal(keys(), (n, k), E4M3)
  scale = jax.random.uniform(keys(), (), jnp.float32, 0.25, 4.0)
  out = np.asarray(_interpreted(kernel, config, layout, a, b_nk, scale),
                   np.float32)
  assert np.isfinite(out).all(), "unwritten (NaN) output elements"
  ref = (np.asarray(a, np.float32) @ np.asarray(b_nk, np.float32).T
         * np.float32(scale))
  assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOLERANCE


def _fp8_pick(collective):
  """`selection`'s fp8 config (bf16 results) for a problem where it takes
  the 64 x 256 one-slot tiles (`heuristics._wide_tiles`)."""
  from collective_matmul import selection  # pylint: disable=g-import-not-at-top
  lhs, rhs = ((E4M3, None) if collective == "all_gather" else (E5M2, E4M3))
  problem = selection.Problem(4096, 2048, 2048, lhs, 1, jnp.bfloat16, rhs)
  device = selection.DeviceFacts("gpu", "NVIDIA H200", 132)
  return selection.config_for(collective, problem, device)[0]


@interpret_mode
@pytest.mark.usefixtures("fresh_interpreter")
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_fp8_picks_run_several_chained_tiles_per_block(collective, keys,
                                                       monkeypatch):
  """The fp8 picks (one-slot epilogue, chained) with 2 blocks, so each
  runs 4 tiles: the epilogue slot and the pipeline's slots reused from
  tile to tile, chained off the pipeline depth (4 k steps, 3 stages)."""
  from collective_matmul.kernels import configs  # pylint: disable=g-import-not-at-top
  config = _fp8_pick(collective)
  assert config.epi_slots == 1 and config.chain_tiles
  monkeypatch.setattr(configs, "sm_count", lambda device=None: 2)
  _check_interpreted(collective, config, 512, 512, 512, keys)


PINGPONG = dict(tile_k=128, pingpong=True, chain_tiles=True)


@interpret_mode
@pytest.mark.usefixtures("fresh_interpreter")
@pytest.mark.parametrize("collective,config,n", [
    ("all_gather", AG(epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                      max_concurrent_steps=5, **PINGPONG), 640),
    ("all_gather", AG(tile_n=192, **PINGPONG), 576),
    ("reduce_scatter", RS(epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                          max_concurrent_steps=5, **PINGPONG), 640),
], ids=["all_gather_one_slot", "all_gather_192", "reduce_scatter_one_slot"])
def test_fp8_pingpong_warpgroups_alternate_tiles(collective, config, n, keys,
                                                 monkeypatch):
  """Ping-pong warpgroups (`TileConfig.pingpong`) on fp8 operands, the
  weight K-major: 2 blocks of 15 or 9 whole 128 x n tiles, so each
  warpgroup runs several, one block one tile more (an odd count: the
  warpgroups' turns continue across the block's tiles), the one ring of
  5 or 4 slots reused off its depth (3 k steps)."""
  from collective_matmul.kernels import configs  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(configs, "sm_count", lambda device=None: 2)
  _check_interpreted(collective, config, 384, 384, n, keys)


@interpret_mode
@pytest.mark.usefixtures("fresh_interpreter")
def test_a_bf16_weight_given_k_major_runs_in_interpret_mode(keys):
  """The K-major path is not fp8's alone: 16-bit operands are read
  transposed from shared memory too."""
  m, k, n = 64, 128, 128
  a = normal(keys(), (m, k), jnp.bfloat16)
  b_nk = normal(keys(), (n, k), jnp.bfloat16)
  out = _interpreted(kernels.all_gather_lhs_matmul, AG(**SMALL),
                     dict(weight_layout="nk"), a, b_nk, jnp.float32(1.0))
  out = np.asarray(out, np.float32)
  ref = np.asarray(a, np.float32) @ np.asarray(b_nk, np.float32).T
  assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOLERANCE
