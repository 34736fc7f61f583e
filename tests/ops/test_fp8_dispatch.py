"""fp8 operands dispatched to the Hopper kernels, on CPU: the ops and the
drop-in with `pallas` (on devices described as H200s) lowered for CUDA
(JAX >= 0.12), the weight handed to the kernel K-major (`[n, k]`); and the
ops run through the kernels in Mosaic GPU's interpret mode at D = 1
(JAX >= 0.12) against an f32 product of the same fp8 values.

tests/gpu/test_fp8_dispatch_gpu.py runs the same dispatch on a Hopper GPU.
"""
import functools
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from collective_matmul import kernels
from collective_matmul import selection

from cm_test_utils import mesh_1d
from cm_test_utils import normal

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
pytestmark = pytest.mark.skipif(
    _VERSION < (0, 12), reason="Mosaic GPU lowers off GPU from JAX 0.12 on")


@pytest.fixture
def h200s(monkeypatch):
  """The ops and the drop-in choose as on H200s (nothing runs on them)."""
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  monkeypatch.setattr(selection, "device_facts",
                      lambda mesh=None: selection.DeviceFacts(
                          "gpu", "NVIDIA H200", 132, 1, 8))


def _kernel_calls(text):
  return len(re.findall(r"custom_call @mosaic_gpu", text))


def _abstract(mesh, shape, dtype, spec):
  return jax.ShapeDtypeStruct(shape, dtype,
                              sharding=NamedSharding(mesh, spec))


def _lowered(mesh, fn, args):
  with jax.set_mesh(mesh):
    return jax.jit(fn).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()


def _op(collective, lhs_dtype, d, m=512, k=1024, n=512):
  """(mesh, the shard_map'd op with impl="pallas" and a scale, abstract x,
  w and scale)."""
  mesh = mesh_1d(d)
  if collective == "all_gather":
    op = functools.partial(cm.all_gather_matmul, gather_axis=0)
    specs = (P("x", None), P(None, "x"), P(None, "x"))
    shapes = ((d * m, k), (k, d * n))
  else:
    op = functools.partial(cm.matmul_reduce_scatter, scatter_axis=0)
    specs = (P(None, "x"), P("x", None), P("x", None))
    shapes = ((d * m, d * k), (d * k, n))
  fn = jax.shard_map(
      lambda x, w, s: op(x, w, "x", impl="pallas",
                         preferred_element_type=jnp.bfloat16, scale=s),
      in_specs=specs[:2] + (P(),), out_specs=specs[2], check_vma=False)
  args = [_abstract(mesh, shapes[0], lhs_dtype, specs[0]),
          _abstract(mesh, shapes[1], E4M3, specs[1]),
          _abstract(mesh, (), jnp.float32, P())]
  return mesh, fn, args


@pytest.mark.usefixtures("h200s")
@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("collective,lhs_dtype", [
    ("all_gather", E4M3), ("all_gather", E5M2), ("reduce_scatter", E4M3),
    ("reduce_scatter", E5M2)], ids=["ag_e4m3", "ag_e5m2", "rs_e4m3",
                                    "rs_e5m2"])
def test_fp8_ops_lower_to_one_kernel_given_the_weight_k_major(
    collective, lhs_dtype, d):
  mesh, fn, args = _op(collective, lhs_dtype, d)
  text = _lowered(mesh, fn, args)
  assert _kernel_calls(text) == 1
  # The local weight [k, n] = [1024, 512] reaches the kernel as [n, k].
  assert re.search(r"stablehlo\.transpose .*-> tensor<512x1024xf8E4M3FN>",
                   text), "the weight is not handed over K-major"


@pytest.mark.usefixtures("h200s")
def test_grad_of_an_fp8_op_lowers_the_fp8_kernel_and_a_bf16_backward():
  """The forward's e4m3 kernel, and the backward's dx through the other
  collective's kernel on the bf16 cotangent (the weight met as bf16); the
  scale's gradient, the unscaled product, runs the forward's kernel
  again."""
  mesh, fn, args = _op("all_gather", E4M3, 2)
  plan = selection.choose(
      "pallas", "all_gather",
      selection.Problem(512, 1024, 512, np.dtype(E4M3), 2,
                        np.dtype(jnp.bfloat16)),
      selection.device_facts())
  assert plan.backward_impl == "pallas" and plan.backward_config.tile_k == 64
  loss = lambda x, w, s: jnp.sum(fn(x, w, s).astype(jnp.float32))
  text = _lowered(mesh, jax.value_and_grad(loss, (0, 1, 2)), args)
  assert _kernel_calls(text) == 3


@pytest.mark.usefixtures("h200s")
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_the_fp8_drop_in_lowers_to_the_kernel_and_records_the_dtypes(
    collective):
  mesh = mesh_1d(2)
  if collective == "all_gather":
    # Flax's forward: e4m3 x e4m3, the rows gathered.
    lhs = _abstract(mesh, (4, 512, 1024), E4M3, P(None, "x", None))
    rhs = _abstract(mesh, (1024, 1024), E4M3, P(None, "x"))
    dims, out_sharding = (((2,), (0,)), ((), ())), None
  else:
    # Flax's dgrad: the e5m2 cotangent times the e4m3 weight [k, n],
    # contracting its n, wanted in the activation's layout.
    lhs = _abstract(mesh, (4, 512, 1024), E5M2, P(None, None, "x"))
    rhs = _abstract(mesh, (1024, 1024), E4M3, P(None, "x"))
    dims = (((2,), (1,)), ((), ()))
    out_sharding = NamedSharding(mesh, P(None, "x", None))
  f = functools.partial(cm.dot_general, dimension_numbers=dims,
                        preferred_element_type=jnp.bfloat16,
                        out_sharding=out_sharding)
  with cm.config_context(enabled=True, impl="pallas"):
    text = _lowered(mesh, f, [lhs, rhs])
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.collective == collective
  label = ("e4m3 x e4m3 -> bf16" if collective == "all_gather"
           else "e5m2 x e4m3 -> bf16")
  assert decision.dtype == label
  assert decision.what_runs().startswith(f"pallas {label} ")
  assert "x128 s" in decision.what_runs()  # tile_k 128.
  # The line names the call's dtypes once; the backward (the drop-in's own,
  # on the bf16 cotangent) its own.
  line = str(decision)
  assert f"{label}: rewritten -> pallas " in line, line
  assert ", backward pallas bf16 " in line, line
  assert _kernel_calls(text) == 1


# ------------------------------------------------------ Mosaic GPU interpreter

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
interpret_mode = pytest.mark.skipif(
    not hasattr(plgpu, "force_gpu_interpret_mode"),
    reason="Mosaic GPU interpret mode needs JAX >= 0.12")
# fp8 products summed in f32 and rounded once to bf16 (~2e-3 relative).
TOLERANCE = 5e-3
# Small tiles, so that the interpreter runs several tiles and k steps fast.
SMALL = dict(tile_m=64, tile_n=64, tile_k=128, wg_dimension="m",
             epi_tile_m=64, epi_tile_n=64, max_concurrent_steps=2)


@pytest.fixture
def _fresh_interpreter():
  yield
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # pylint: disable=g-import-not-at-top
  gpu_callbacks.reset_gpu_interpret_mode_state()


@interpret_mode
@pytest.mark.usefixtures("h200s", "_fresh_interpreter")
@pytest.mark.parametrize("collective,lhs_dtype,weight_k_major", [
    ("all_gather", E4M3, False), ("reduce_scatter", E5M2, True)],
                         ids=["all_gather_e4m3", "reduce_scatter_e5m2_dgrad"])
def test_fp8_op_runs_through_the_kernel_in_interpret_mode(
    collective, lhs_dtype, weight_k_major, keys):
  """m and n off the tiles, 3 k steps, a scale. The reduce-scatter gets its
  weight as the transpose of a K-major array, as the drop-in's dgrad
  does."""
  m, k, n = 96, 384, 160
  a = normal(keys(), (m, k), lhs_dtype)
  w_nk = normal(keys(), (n, k), E4M3)
  weight = w_nk if weight_k_major else jnp.asarray(np.asarray(w_nk).T)
  op, config = ((cm.all_gather_matmul, kernels.AllGatherConfig(**SMALL))
                if collective == "all_gather" else
                (cm.matmul_reduce_scatter,
                 kernels.ReduceScatterConfig(**SMALL)))

  scale = jax.random.uniform(keys(), (), jnp.float32, 0.25, 4.0)

  def body(a, weight, scale):
    w = weight.T if weight_k_major else weight
    return op(a, w, "x", impl="pallas", kernel_config=config,
              preferred_element_type=jnp.bfloat16, scale=scale)

  with plgpu.force_gpu_interpret_mode(
      plgpu.InterpretGPUParams(detect_races=True, on_race="raise")):
    with jax.set_mesh(mesh_1d(1)):
      out = jax.jit(jax.shard_map(body, in_specs=(P(), P(), P()),
                                  out_specs=P(), check_vma=False))(
                                      a, weight, scale)
  assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
  out = np.asarray(out, np.float32)
  assert np.isfinite(out).all(), "unwritten (NaN) output elements"
  ref = (np.asarray(a, np.float32) @ np.asarray(w_nk, np.float32).T
         * np.float32(scale))
  assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOLERANCE
