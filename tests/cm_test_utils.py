"""The one helper module of the tests: meshes, inputs, references, the
tolerances, the compiled-program helpers and the scripts as modules (the
seed fixtures `keys` and `rng` are in conftest.py)."""
from __future__ import annotations

import difflib
import functools
import importlib
import os
import re
import subprocess
import sys

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

DN_LAST = lambda ndim: (((ndim - 1,), (0,)), ((), ()))  # x[..., k] @ w[k, n]
SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "scripts")
TOOLS = os.path.join(os.path.dirname(SCRIPTS), "tools")


def pallas_mlp(save_gathered):
  """An MLP block through both ops with impl="pallas" (inside shard_map
  over "x"): x [b, s/D, d] gathered on s times wi [d, f/D], gelu, times wo
  [f/D, d] reduce-scattered back on s. Its value_and_grad runs both kernels
  in the forward and, transposed, in the backward."""
  import collective_matmul as cm  # pylint: disable=g-import-not-at-top

  def mlp(x, wi, wo):
    h = cm.all_gather_matmul(x, wi, "x", gather_axis=1, impl="pallas",
                             save_gathered=save_gathered)
    return cm.matmul_reduce_scatter(jax.nn.gelu(h), wo, "x", scatter_axis=1,
                                    impl="pallas",
                                    save_gathered=save_gathered)
  return mlp


# TileConfig fields of two tilings the fp8 and rowwise tests run in every
# kernel: 64 x 256 warpgroup tiles (split along m) with a one-slot epilogue
# (fp8's pick, `heuristics._wide_tiles`), and ping-pong warpgroups on
# whole 128 x 128 tiles with a one-slot epilogue.
ONE_SLOT_WIDE = dict(tile_m=64, tile_n=256, wg_dimension="m", epi_tile_m=64,
                     epi_tile_n=256, epi_slots=1, max_concurrent_steps=3,
                     chain_tiles=True)
PINGPONG_ONE_SLOT = dict(pingpong=True, chain_tiles=True, epi_tile_m=128,
                         epi_tile_n=128, epi_slots=1, max_concurrent_steps=5)


def kernel_configs(pattern):
  """{name: config} of the Hopper kernels that the CPU kernel tests (lowered
  for CUDA, interpreted) cover: each schedule and send kind, chained at and
  off the pipeline depth (`_OffsetChain`), 64 x 256 warpgroup tiles,
  one-slot epilogues and (on a one-device axis only) ping-pong
  warpgroups.
  `pattern`: "all_gather" or "reduce_scatter"."""
  from collective_matmul import kernels  # pylint: disable=g-import-not-at-top
  ag, rs = kernels.AllGatherConfig, kernels.ReduceScatterConfig
  if pattern == "all_gather":
    return {
        "default": ag(),
        "eager_chained": ag(eager_release=True, chain_tiles=True),
        "k_major_senders": ag(sender_sms=4, k_major_sends=True),
        "by_rows_senders_chained": ag(sender_sms=4, chain_tiles=True),
        # Chained off the pipeline depth, with each kind of send.
        "offset_chain_eager": ag(eager_release=True, chain_tiles=True,
                                 max_concurrent_steps=3),
        "offset_chain_k_major": ag(sender_sms=4, k_major_sends=True,
                                   chain_tiles=True, max_concurrent_steps=3),
        "offset_chain_by_rows": ag(sender_sms=4, chain_tiles=True,
                                   max_concurrent_steps=3),
        "wide_k_senders": ag(tile_n=64, tile_k=128, max_concurrent_steps=3,
                             sender_sms=4, k_major_sends=True),
        "wide_warpgroup_tiles": ag(tile_m=64, tile_n=256, wg_dimension="m",
                                   eager_release=True, chain_tiles=True),
        # One epilogue slot, the whole warpgroup tile (`epi_slots`).
        "one_slot_epilogue": ag(epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                                max_concurrent_steps=3, chain_tiles=True),
        "one_slot_wide": ag(tile_m=64, tile_n=256, wg_dimension="m",
                            epi_tile_m=64, epi_tile_n=256, epi_slots=1,
                            max_concurrent_steps=3, chain_tiles=True),
        # Ping-pong warpgroups (one-device axis only), each on whole
        # 128 x 128 tiles; a one-slot epilogue too.
        "pingpong": ag(chain_tiles=True, pingpong=True),
        # In the ring: the tiles forward from slots freed at once, or
        # dedicated senders do.
        "pingpong_eager": ag(chain_tiles=True, pingpong=True,
                             eager_release=True),
        "pingpong_senders": ag(chain_tiles=True, pingpong=True,
                               sender_sms=4),
        "pingpong_one_slot": ag(chain_tiles=True, pingpong=True,
                                epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                                max_concurrent_steps=5),
    }
  if pattern == "reduce_scatter":
    return {
        "default": rs(),
        "whole_tile_epilogue": rs(epi_tile_n=128, max_concurrent_steps=3,
                                  send_pieces=4, send_gap=3),
        "chained": rs(chain_tiles=True),
        "offset_chain": rs(epi_tile_n=128, max_concurrent_steps=3,
                           send_pieces=2, chain_tiles=True),
        "wide_warpgroup_tiles": rs(tile_m=64, tile_n=256, wg_dimension="m"),
        "one_slot_epilogue": rs(epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                                max_concurrent_steps=3, send_pieces=2),
        "one_slot_wide_chained": rs(tile_m=64, tile_n=256, wg_dimension="m",
                                    epi_tile_m=64, epi_tile_n=256,
                                    epi_slots=1, max_concurrent_steps=3,
                                    send_pieces=2, chain_tiles=True),
        "pingpong": rs(chain_tiles=True, pingpong=True),
    }
  raise ValueError(f"pattern {pattern!r}")


def import_script(name):
  """scripts/<name>.py or tools/<name>.py as a module, for its functions.
  What importing it sets in os.environ for a GPU run (NCCL and XLA
  variables) and in sys.path is undone, so the rest of the test session
  does not see it."""
  saved, saved_path = dict(os.environ), list(sys.path)
  sys.path[:0] = [SCRIPTS, TOOLS]
  try:
    return importlib.import_module(name)
  finally:
    sys.path[:] = saved_path
    os.environ.clear()
    os.environ.update(saved)


def mesh_1d(d, axis_type=AxisType.Explicit, name="x"):
  return jax.make_mesh((d,), (name,), devices=jax.devices()[:d],
                       axis_types=(axis_type,))


def mesh_2d(shape, axis_type=AxisType.Explicit):
  return jax.make_mesh(shape, ("data", "tensor"),
                       devices=jax.devices()[:shape[0] * shape[1]],
                       axis_types=(axis_type, axis_type))


def needs_interpret_mode():
  """A skip mark for tests that run the kernels in Mosaic GPU's interpret
  mode on CPU (JAX >= 0.12: 0.11's interpreter has no `on_race`, which the
  tests set to fail on a race). Pallas is imported only here, when a test
  module asks."""
  import inspect  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top
  plgpu = importlib.import_module("jax.experimental.pallas.mosaic_gpu")
  params = getattr(plgpu, "InterpretGPUParams", None)
  usable = (hasattr(plgpu, "force_gpu_interpret_mode") and params is not None
            and "on_race" in inspect.signature(params).parameters)
  return pytest.mark.skipif(not usable, reason="Mosaic GPU interpret mode "
                            "(with on_race) needs JAX >= 0.12")


# Interpreted kernels: products summed in f32 and rounded once to bf16
# (~1.6e-3 relative, in the norm).
INTERPRET_TOLERANCE = 5e-3
# Small warpgroup tiles (a 128 x 64 CTA tile), so that the interpreter runs
# several tiles and k steps fast.
INTERPRET_TILES = dict(tile_m=64, tile_n=64, wg_dimension="m", epi_tile_m=64,
                       epi_tile_n=64, max_concurrent_steps=2)


def rowwise_plan(collective, shape, axis, out_dtype, **tiles):
  """A `pallas` plan for an fp8 op with row and column scales at D = 1
  (tests/ops/test_rowwise_dispatch_interpret.py, tests/gpu/
  test_rowwise_dispatch_gpu.py): the collective's kernel config with fp8's
  tile_k and `tiles`, as many pipeline stages as fit a block's shared
  memory beside `out_dtype`'s epilogue, the weight K-major."""
  from collective_matmul import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from collective_matmul.enums import Collective  # pylint: disable=g-import-not-at-top
  from collective_matmul.kernels import configs  # pylint: disable=g-import-not-at-top
  config_type = (configs.AllGatherConfig if collective == "all_gather"
                 else configs.ReduceScatterConfig)
  config = config_type(tile_k=configs.FP8_TILE_K, **tiles).fit_shared_memory(
      1, jnp.dtype(out_dtype).itemsize)
  return plan_lib.KernelPlan(
      "pallas", "ring", config=config, weight_layout="nk").for_rows(
          *plan_lib.kernel_rows(Collective.parse(collective, "collective"),
                                shape, axis, 1))


def rowwise_op(collective, axis, out_dtype, **how):
  """The op with row and column scales at D = 1, jitted, over `x, w,
  row_scale, col_scale` (each whole on the one device); `how`: `plan=` or
  `impl=`."""
  import collective_matmul as cm  # pylint: disable=g-import-not-at-top
  op, axis_arg = ((cm.all_gather_matmul, "gather_axis")
                  if collective == "all_gather"
                  else (cm.matmul_reduce_scatter, "scatter_axis"))
  return jax.jit(jax.shard_map(
      lambda x, w, r, c: op(x, w, "x", preferred_element_type=out_dtype,
                            row_scale=r, col_scale=c, **{axis_arg: axis},
                            **how),
      in_specs=(P(),) * 4, out_specs=P(), check_vma=False))


# The rowwise dispatch's cases on a GPU (tests/gpu/
# test_rowwise_dispatch_gpu.py), whose plans tests/ops/
# test_rowwise_dispatch_interpret.py lowers on CPU: the collective and its
# lhs dtype, the local x's shape and its rows' axis, the result dtype.
ROWWISE_DISPATCH_CASES = pytest.mark.parametrize(
    "collective,lhs_dtype,shape,axis,out_dtype",
    [pytest.param(collective, lhs, shape, axis, out,
                  id=f"{collective}-{rows}-{jnp.dtype(out).name}")
     for collective, lhs in (("all_gather", jnp.float8_e4m3fn),
                             ("reduce_scatter", jnp.float8_e5m2))
     for rows, shape, axis in (("rows", (1024, 2048), 0),
                               ("batch_of_rows", (2, 512, 2048), 1))
     for out in (jnp.bfloat16, jnp.float32)])


def normal(key, shape, dtype):
  return jax.random.normal(key, shape, jax.numpy.float32).astype(dtype)


def reference(x, w):
  """float64 `x[..., k] @ w[k, n]` of the (possibly bf16) inputs."""
  return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def max_rel_error(out, ref):
  """Largest elementwise error relative to the largest reference entry.

  Stricter than a norm ratio: a single wrong entry of typical size counts
  fully, so a misplaced block can't hide among correct ones.
  """
  out = np.asarray(out, np.float64)
  assert out.shape == ref.shape, (out.shape, ref.shape)
  assert np.isfinite(out).all()
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def assert_close(out, ref, rel):
  err = max_rel_error(out, ref)
  assert err <= rel, f"max error {err:.3g} of max |ref| exceeds {rel:.3g}"


# One table for every comparison: float32 results agree to rounding; bf16
# inputs and partial sums to a few percent, which a misplaced, missing or
# doubled row block (off by about the data's magnitude) never meets.
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}


def put(array, mesh, spec):
  """`array` placed on `mesh` with partition spec `spec`."""
  return jax.device_put(array, jax.sharding.NamedSharding(mesh, spec))


def compiled_hlo(mesh, f, *args, **config) -> str:
  """The compiled program of `jax.jit(f)(*args)` on `mesh` with the plugin's
  configuration `config` (a fresh function object per configuration: jit's
  cache does not key on it)."""
  import collective_matmul as cm  # pylint: disable=g-import-not-at-top
  with jax.set_mesh(mesh), cm.config_context(**config):
    return jax.jit(f).lower(*args).compile().as_text()


def normalized_hlo(text: str) -> str:
  """The program without names and debug info that differ by caller only.

  Drops the module name, the FileNames/FunctionNames/FileLocations/
  StackFrames tables (source locations of the Python callers) and every
  instruction's metadata={...} (op_name and stack frame ids). Instructions,
  shapes, shardings, collectives and fusions are kept.
  """
  text = re.sub(r"^HloModule \S+,", "HloModule M,", text, flags=re.M)
  text = re.sub(r"\nFileNames\n.*?\n\n(?=%|ENTRY)", "\n", text, flags=re.S)
  return re.sub(r", metadata=\{[^}]*\}", "", text)


def hlo_diff(reference: str, other: str, names=("reference", "other")) -> str:
  """The unified diff of two compiled programs, normalized; empty if the
  same program."""
  return "\n".join(difflib.unified_diff(
      normalized_hlo(reference).splitlines(),
      normalized_hlo(other).splitlines(), *names, lineterm=""))


# --------------------------- shard_map helpers of the collective-op tests

# (data, tensor) mesh shapes: 1-D rings of D devices and the 2-D meshes.
MESH_SHAPES = ((1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (4, 2))


def mesh(data: int, tensor: int, axis_type=AxisType.Auto):
  """A ("data", "tensor") mesh over the first data * tensor devices."""
  return jax.make_mesh((data, tensor), ("data", "tensor"),
                       devices=jax.devices()[:data * tensor],
                       axis_types=(axis_type,) * 2)


def cast(array: np.ndarray, dtype) -> jax.Array:
  return jnp.asarray(array, jnp.float32).astype(dtype)


def exact(array) -> np.ndarray:
  """The value an array holds, in float64, for references."""
  return np.asarray(jnp.asarray(array, jnp.float32), np.float64)


def assert_close_to_scale(actual, expected, *, dtype, scale=None):
  """Elementwise equal within `TOLERANCE[dtype]`, relative to each entry and
  to the data's magnitude: a misplaced or missing row block is off by about
  `scale` and fails."""
  actual, expected = exact(actual), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  scale = float(np.std(expected)) if scale is None else scale
  tolerance = TOLERANCE[jnp.dtype(dtype).name]
  np.testing.assert_allclose(actual, expected, rtol=tolerance,
                             atol=tolerance * scale)


def reduce_scatter_specs(ndim: int, scatter_axis: int):
  """shard_map specs for x[..., F@tensor] @ w[F@tensor, E] -> rows over
  tensor on `scatter_axis`, with batch (dim 0) over data."""
  x_spec = ["data"] + [None] * (ndim - 2) + ["tensor"]
  out_spec = ["data"] + [None] * (ndim - 1)
  if scatter_axis == 0:
    out_spec[0] = ("data", "tensor")
  else:
    out_spec[scatter_axis] = "tensor"
  return (P(*x_spec), P("tensor", None)), P(*out_spec)


def all_gather_specs(ndim: int, gather_axis: int):
  """shard_map specs for x[B@data, S@tensor, E] @ w[E, F@tensor] (rows
  gathered over tensor on `gather_axis`)."""
  x_spec = ["data"] + [None] * (ndim - 1)
  if gather_axis == 0:
    x_spec[0] = ("data", "tensor")
  else:
    x_spec[gather_axis] = "tensor"
  out_spec = ["data"] + [None] * (ndim - 2) + ["tensor"]
  return (P(*x_spec), P(None, "tensor")), P(*out_spec)


def sharded(fn, the_mesh, in_specs, out_spec, **kwargs):
  """`fn(x, w, 'tensor', **kwargs)` as a jitted shard_map over the mesh."""
  body = functools.partial(fn, axis_name="tensor", **kwargs)
  return jax.jit(jax.shard_map(body, mesh=the_mesh, in_specs=in_specs,
                               out_specs=out_spec, check_vma=False))


def count_ops(hlo_text: str, op: str) -> int:
  """How many `op` instructions (sync or async start) a compiled HLO has."""
  return len(re.findall(rf"= \S+ {op}(-start)?\(", hlo_text))


def wait_for_processes(procs, timeout_s, hang_message):
  """The outputs of `procs` (started with stdout piped, text mode); on a
  timeout every one is killed and the test fails with `hang_message` (one
  process of a ring that hangs leaves the others waiting)."""
  logs = []
  for proc in procs:
    try:
      logs.append(proc.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
      for other in procs:
        other.kill()
      pytest.fail(hang_message)
  return logs
