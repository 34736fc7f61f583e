"""The dispatch hands the Hopper kernels the ops' row and column scales in
their layout (the rows as the kernel sees them, also with the split
dimension moved first; the fp8 weight K-major): a `pallas` plan given to the
op, run in Mosaic GPU's interpret mode on CPU at D = 1, equals the ring. And
the GPU test of this dispatch (tests/gpu/test_rowwise_dispatch_gpu.py) at
its shapes, tiles and result dtypes lowers for CUDA: its f32 results once
asked for a config needing more shared memory than a block has, which only
the GPU run found.

Skipped where the kernels take no `row_scale` (a tree before issue 55's
kernel half, whose test helpers for the interpreter this file uses) or JAX
has no interpret mode (< 0.12)."""
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from collective_matmul import kernels
from cm_test_utils import mesh_1d, normal, rowwise_op, rowwise_plan
from cm_test_utils import ROWWISE_DISPATCH_CASES  # pylint: disable=g-bad-import-order

if "row_scale" not in inspect.signature(
    kernels.all_gather_lhs_matmul).parameters:
  pytest.skip("these kernels take no row_scale / col_scale",
              allow_module_level=True)
from cm_test_utils import INTERPRET_TILES, needs_interpret_mode  # pylint: disable=g-import-not-at-top,g-bad-import-order

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
E4M3 = jnp.float8_e4m3fn
pytestmark = [needs_interpret_mode(),
              pytest.mark.usefixtures("fresh_interpreter")]


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("shape,axis", [((128, 256), 0), ((2, 64, 256), 1)],
                         ids=["rows", "batch_of_rows"])
def test_a_pallas_plan_with_row_and_column_scales_is_the_ring_s_product(
    collective, shape, axis, keys):
  x = normal(keys(), shape, jnp.float32).astype(E4M3)
  w = normal(keys(), (256, 128), jnp.float32).astype(E4M3)
  row = jax.random.uniform(keys(), shape[:-1], jnp.float32, 0.25, 4.0)
  col = jax.random.uniform(keys(), (128,), jnp.float32, 0.25, 4.0)
  plan = rowwise_plan(collective, shape, axis, jnp.float32,
                      **INTERPRET_TILES)

  def run(**how):
    with jax.set_mesh(mesh_1d(1)):
      return np.asarray(rowwise_op(collective, axis, jnp.float32, **how)(
          x, w, row, col))
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got = run(plan=plan)
  want = run(impl="ring")
  np.testing.assert_allclose(got, want, rtol=1e-5,
                             atol=1e-5 * np.abs(want).max())
  # The positive control: without its row scales the product is far off.
  unscaled = want / np.asarray(row)[..., None]
  assert np.abs(got - unscaled).max() > 0.1 * np.abs(unscaled).max()


@ROWWISE_DISPATCH_CASES
def test_the_gpu_test_s_plans_lower_for_cuda(collective, lhs_dtype, shape,
                                             axis, out_dtype):
  n = 1024
  f = rowwise_op(collective, axis, out_dtype,
                 plan=rowwise_plan(collective, shape, axis, out_dtype))
  args = [jax.ShapeDtypeStruct(shape, lhs_dtype),
          jax.ShapeDtypeStruct((shape[-1], n), E4M3),
          jax.ShapeDtypeStruct(shape[:-1], jnp.float32),
          jax.ShapeDtypeStruct((n,), jnp.float32)]
  with jax.set_mesh(mesh_1d(1)):
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"@mosaic_gpu", text)) == 1
