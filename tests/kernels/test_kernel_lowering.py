"""The Hopper kernels lowered for CUDA on a machine without a GPU.

With JAX >= 0.11 Pallas lowers a Mosaic GPU kernel to its MLIR (layout
inference, barriers, TMA descriptors) without a GPU, so CI's Python 3.12
stages (JAX 0.12, and the GPU image's 0.11.2) catch what tracing alone cannot (an unsupported op, a layout Mosaic
cannot infer) before a GPU run. JAX 0.10 fails layout inference off GPU for
every config ("Failed to infer a possible set of layouts"), so the Python
3.11 suite skips this file; the GPU machine runs 0.11, where tests/gpu
checks the numerics. Kernels under `trace_warpgroups` cannot lower here:
their trace is written by a host callback, which needs the CUDA backend
(tests/gpu/test_kernel_traces.py covers them).
"""
import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul import kernels
from collective_matmul import selection

from cm_test_utils import kernel_configs
from cm_test_utils import pallas_mlp

_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
pytestmark = pytest.mark.skipif(
    _VERSION < (0, 11), reason="Mosaic GPU lowers off GPU from JAX 0.11 on")

ALL_GATHER = kernel_configs("all_gather")
REDUCE_SCATTER = kernel_configs("reduce_scatter")


def _kernel_calls(text):
  """Mosaic GPU kernel calls in lowered StableHLO."""
  return len(re.findall(r"custom_call @mosaic_gpu", text))


def _mesh(d):
  return jax.make_mesh((d,), ("x",), devices=jax.devices()[:d],
                       axis_types=(jax.sharding.AxisType.Explicit,))


def _lower(mesh, fn, in_specs, shapes, out_spec):
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16,
                               sharding=NamedSharding(mesh, spec))
          for s, spec in zip(shapes, in_specs)]
  with jax.set_mesh(mesh):
    f = jax.jit(jax.shard_map(fn, out_specs=out_spec, check_vma=False))
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _lower_all_gather(d, config, m=512, k=1024, n=512):
  return _lower(_mesh(d), functools.partial(
      kernels.all_gather_lhs_matmul, axis_name="x", config=config),
                [P("x", None), P(None, "x")], [(d * m, k), (k, d * n)],
                P(None, "x"))


def _lower_reduce_scatter(d, config, m=512, k=1024, n=512):
  return _lower(_mesh(d), functools.partial(
      kernels.matmul_reduce_scatter, axis_name="x", config=config),
                [P(None, "x"), P("x", None)], [(d * m, d * k), (d * k, n)],
                P("x", None))


def _lowers_or_refuses_in_a_ring(lower, d, config):
  """One kernel call; a config the ring cannot run (ping-pong in the
  all-gather's ring with tiles that free their slots a step late) is
  refused instead (`configs.axis_reason`)."""
  from collective_matmul.kernels import configs  # pylint: disable=g-import-not-at-top
  reason = configs.axis_reason(config, d)
  if reason:
    with pytest.raises(ValueError, match=re.escape(reason[:40])):
      lower(d, config)
  else:
    assert _kernel_calls(lower(d, config)) == 1


@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("name", sorted(ALL_GATHER))
def test_all_gather_kernel_lowers_for_cuda(name, d):
  _lowers_or_refuses_in_a_ring(_lower_all_gather, d,
                               ALL_GATHER[name])


@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("name", sorted(REDUCE_SCATTER))
def test_reduce_scatter_kernel_lowers_for_cuda(name, d):
  _lowers_or_refuses_in_a_ring(_lower_reduce_scatter, d,
                               REDUCE_SCATTER[name])


@pytest.mark.parametrize("n", [264, 320, 1000, 1088])
@pytest.mark.parametrize("d", [1, 2])
def test_columns_off_the_tiles_lower_for_cuda(d, n):
  """n off the CTA tiles, on and off the shared-memory tiling's width (64
  bf16 columns): left to TMA (`ring_skeleton.clips_columns`) only where
  TMA takes it, padded elsewhere; before that rule, 264 and 1000 failed to
  lower ("dimension 1 must have size smaller or a multiple of its tiling
  64")."""
  ag, rs = kernels.AllGatherConfig(), kernels.ReduceScatterConfig()
  assert _kernel_calls(_lower_all_gather(d, ag, 256, 1024, n)) == 1
  assert _kernel_calls(_lower_reduce_scatter(d, rs, 256, 1024, n)) == 1


# What `impl=auto` runs at D = 2: the seed shape, 512 rows, small problems
# inside the boxes, llama2-7b's projections at tensor-sequence 2 (k = 5504:
# chained off the pipeline depth) and a shape the table holds.
SHAPES = ["1024/4096/4096", "512/4096/4096", "256/4096/4096", "128/4096/2048",
          "8192/4096/2048", "8192/2048/4096", "8192/4096/5504",
          "8192/5504/4096", "4096/7168/8192"]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_picked_configs_lower_for_cuda(shape):
  from collective_matmul import selection  # pylint: disable=g-import-not-at-top
  m, k, n = map(int, shape.split("/"))
  ag = selection.select_config(m, k, n, jnp.bfloat16, 2)
  rs = selection.select_reduce_scatter_config(m, k, n, jnp.bfloat16, 2)
  assert _kernel_calls(_lower_all_gather(2, ag, m, k, n)) == 1
  assert _kernel_calls(_lower_reduce_scatter(2, rs, m, k, n)) == 1


def _mesh_described_as_h200s(monkeypatch):
  """A 2-device mesh; the ops refuse impl="pallas" where no Hopper GPU is,
  so the devices are described as H200s (here nothing runs)."""
  monkeypatch.setattr(selection, "device_facts",
                      lambda mesh=None: selection.DeviceFacts(
                          "gpu", "NVIDIA H200", 132, 1, 8))
  return _mesh(2)


def _mlp_args(mesh, mapped=None):
  """`pallas_mlp`'s x, wi, wo; operand `mapped` with a leading 3."""
  shapes = [(2, 1024, 512), (512, 2048), (2048, 512)]
  specs = [P(None, "x", None), P(None, "x"), P("x", None)]
  return [jax.ShapeDtypeStruct((3,) + s if i == mapped else s, jnp.bfloat16,
                               sharding=NamedSharding(
                                   mesh, P(None, *spec) if i == mapped
                                   else spec))
          for i, (s, spec) in enumerate(zip(shapes, specs))]


@pytest.mark.parametrize("save_gathered", [False, True])
def test_a_pallas_mlp_lowers_for_cuda_forward_and_backward(save_gathered,
                                                           monkeypatch):
  """value_and_grad through both ops with impl="pallas": the forward's two
  kernels and the backward's transposed ones, lowered as one program."""
  mesh = _mesh_described_as_h200s(monkeypatch)
  args = _mlp_args(mesh)
  with jax.set_mesh(mesh):
    f = jax.shard_map(pallas_mlp(save_gathered),
                      out_specs=P(None, "x", None), check_vma=False)
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))
    text = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).trace(
        *args).lower(lowering_platforms=("cuda",)).as_text()
  # Two forward kernels and two in the backward.
  assert _kernel_calls(text) == 4


@pytest.mark.parametrize("transform", ["jvp", "linearize", "jacfwd_w",
                                       "vmap_grad_x", "vmap_grad_w"])
def test_the_pallas_mlp_lowers_for_cuda_under_every_transformation(
    transform, monkeypatch):
  """Forward mode and vmap through both ops with impl="pallas" lower to the
  kernels: jvp's primal kernels plus one per tangent term (the all-gather's
  weight term multiplies the gathered activation its forward kept, a local
  dot); vmap of value_and_grad folds the mapped dimension into the
  kernels' rows or columns (or, where both operands are mapped, maps one
  kernel), so it runs the four kernels of value_and_grad."""
  mesh = _mesh_described_as_h200s(monkeypatch)
  with jax.set_mesh(mesh):
    f = jax.shard_map(pallas_mlp(True), out_specs=P(None, "x", None),
                      check_vma=False)
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))
    run, mapped, kernels_expected = {
        "jvp": (lambda *a: jax.jvp(f, a, a), None, 2 + 3),
        # (Only tangents out: the reduce-scatter's primal is not needed.)
        "linearize": (lambda *a: jax.linearize(f, *a)[1](*a), None, 1 + 3),
        "jacfwd_w": (None, None, None),
        "vmap_grad_x": (jax.vmap(jax.value_and_grad(loss, (0, 1, 2)),
                                 (0, None, None)), 0, 4),
        "vmap_grad_w": (jax.vmap(jax.value_and_grad(loss, (0, 1, 2)),
                                 (None, 0, None)), 1, 4),
    }[transform]
    if transform == "jacfwd_w":
      # jacfwd w.r.t. two scales of wi: two tangents of the weight, mapped
      # (the all-gather's term is the local dot, the reduce-scatter's the
      # kernel with the mapped rows folded in).
      run = lambda x, wi, wo: jax.jacfwd(
          lambda v: loss(x, wi * (v[0] + 2 * v[1]), wo))(
              jnp.ones(2, jnp.bfloat16))
      kernels_expected = 1 + 1  # (The reduce-scatter's primal unused.)
    args = _mlp_args(mesh, mapped)
    text = jax.jit(run).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
  assert _kernel_calls(text) == kernels_expected, _kernel_calls(text)
