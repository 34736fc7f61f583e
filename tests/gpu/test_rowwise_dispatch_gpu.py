"""Rowwise fp8 through the ops' dispatch to the Hopper kernels at D = 1 (one
GPU): `cm.all_gather_matmul` / `cm.matmul_reduce_scatter` given an f32
`row_scale` (one per row of the local x) and `col_scale` (one per column of
the local w) run the kernel with them in its epilogue, the rows as the
kernel sees them (also with the split dimension moved first), the fp8
weight handed over K-major; against the f32 product of the same fp8 values
times the same scales, outputs poisoned. A positive control: the product
without its row scales is far off.

The kernels are reached through an explicit `pallas` plan, as the CPU test
of the same dispatch in interpret mode (tests/ops/
test_rowwise_dispatch_interpret.py, which also lowers this file's plans
for CUDA); `selection.scales_reason` decides
whether `auto` and `pallas` choose them (tests/selection/
test_rowwise_selection.py).

Tolerance: the fp8 products are exact in f32 and Hopper's fp8 MMA
accumulates to about 2e-4 relative; a bf16 result adds one rounding
(tests/gpu/test_fp8_dispatch_gpu.py): 5e-3 of the norm.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np

from cm_test_utils import ROWWISE_DISPATCH_CASES
from cm_test_utils import rowwise_op
from cm_test_utils import rowwise_plan
from gpu_env import poison
from gpu_env import rel_error
from gpu_env import ring_mesh

E4M3 = jnp.float8_e4m3fn
TOLERANCE = 5e-3
f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float32)


@ROWWISE_DISPATCH_CASES
def test_rowwise_op_runs_the_kernel_with_the_ops_scales(
    collective, lhs_dtype, shape, axis, out_dtype):
  n = 1024
  keys = jax.random.split(jax.random.key(7), 4)
  x = jax.random.normal(keys[0], shape, jnp.float32).astype(lhs_dtype)
  w = jax.random.normal(keys[1], (shape[-1], n), jnp.float32).astype(E4M3)
  row = jax.random.uniform(keys[2], shape[:-1], jnp.float32, 0.25, 4.0)
  col = jax.random.uniform(keys[3], (n,), jnp.float32, 0.25, 4.0)
  plan = rowwise_plan(collective, shape, axis, out_dtype)
  f = rowwise_op(collective, axis, out_dtype, plan=plan)
  with jax.set_mesh(ring_mesh(1)):
    text = f.lower(x, w, row, col).as_text()
    poison(np.prod(shape[:-1]) * n * 4)
    got = f(x, w, row, col)
  assert len(re.findall(r"@mosaic_gpu", text)) == 1
  assert got.shape == shape[:-1] + (n,) and got.dtype == out_dtype
  want = (np.einsum("...k,kn->...n", f32(x), f32(w)) * f32(row)[..., None]
          * f32(col))
  assert rel_error(got, want) < TOLERANCE
  unscaled = want / f32(row)[..., None]
  assert rel_error(got, unscaled) > 0.1
