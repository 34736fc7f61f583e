"""fp8 through the ops' dispatch to the Hopper kernels at D = 1 (one GPU):
`cm.all_gather_matmul` / `cm.matmul_reduce_scatter` with impl="pallas",
e4m3 x e4m3 and e5m2 x e4m3, a per-tensor f32 `scale` applied in the
kernels' epilogue, the weight handed over K-major by the dispatch; against
an f32 product of the same fp8 values, with the output memory poisoned.

Tolerances: the fp8 products are exact in f32 and Hopper's fp8 MMA
accumulates to about 2e-4 relative (tests/gpu/test_fp8_kernels_gpu.py);
a bf16 result adds one rounding (unit roundoff 2^-8): 5e-3 of the norm.
An fp8 operand's gradient is rounded to e4m3 once (unit roundoff 2^-4,
about 0.036 of the norm for random values): 0.06.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import collective_matmul as cm

from gpu_env import poison as _poison
from gpu_env import rel_error as _rel
from gpu_env import ring_mesh as _mesh

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
OPS = {"all_gather": cm.all_gather_matmul,
       "reduce_scatter": cm.matmul_reduce_scatter}
BF16_TOLERANCE = 5e-3
FP8_GRAD_TOLERANCE = 0.06
f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float32)


def _operands(seed, m, k, n, lhs_dtype):
  keys = jax.random.split(jax.random.key(seed), 3)
  a = jax.random.normal(keys[0], (m, k), jnp.float32).astype(lhs_dtype)
  w = jax.random.normal(keys[1], (k, n), jnp.float32).astype(E4M3)
  scale = jax.random.uniform(keys[2], (), jnp.float32, 0.25, 4.0)
  return a, w, scale


def _op(collective, weight_given_k_major=False):
  """The op at D = 1 with impl="pallas"; with `weight_given_k_major` it
  takes the weight as [n, k] and passes its transpose (as the drop-in's
  dgrad passes Flax's weight)."""
  op = OPS[collective]

  def body(a, w, s):
    return op(a, w.T if weight_given_k_major else w, "x", impl="pallas",
              preferred_element_type=jnp.bfloat16, scale=s)
  return jax.shard_map(body, in_specs=(P(), P(), P()), out_specs=P(),
                       check_vma=False)


# The last: the all-gather's pick is fp8's 64 x 256 warpgroup tiles with a
# one-slot epilogue (`heuristics._wide_tiles`).
@pytest.mark.parametrize("m,k,n", [(1024, 2048, 1024), (1000, 1600, 768),
                                   (4096, 2048, 2048)], ids=str)
@pytest.mark.parametrize("lhs_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("collective", sorted(OPS))
def test_fp8_op_runs_the_kernel_and_matches_the_scaled_f32_product(
    collective, lhs_dtype, m, k, n):
  a, w, scale = _operands(1, m, k, n, lhs_dtype)
  f = jax.jit(_op(collective))
  with jax.set_mesh(_mesh(1)):
    text = f.lower(a, w, scale).as_text()
    _poison(m * n * 4)
    out = f(a, w, scale)
  assert len(re.findall(r"@mosaic_gpu", text)) == 1
  assert out.shape == (m, n) and out.dtype == jnp.bfloat16
  ref = f32(a) @ f32(w) * np.float32(scale)
  assert _rel(out, ref) < BF16_TOLERANCE


def test_the_dgrad_s_k_major_weight_reaches_the_kernel_untransposed():
  """The reduce-scatter given `w_nk.T` hands the kernel `w_nk` itself: XLA
  folds the caller's transpose and the dispatch's. Positive control: the
  all-gather given a [k, n] weight transposes it."""
  a, w, scale = _operands(2, 1024, 2048, 1024, E5M2)
  w_nk = jnp.asarray(np.asarray(f32(w).T), E4M3)
  with jax.set_mesh(_mesh(1)):
    dgrad = jax.jit(_op("reduce_scatter", weight_given_k_major=True))
    folded = dgrad.lower(a, w_nk, scale).compile().as_text()
    _poison(1024 * 1024 * 4)
    out = dgrad(a, w_nk, scale)
    forward = jax.jit(_op("all_gather")).lower(a.astype(E4M3), w, scale)
    control = forward.compile().as_text()
  assert "transpose(" not in folded, folded
  assert "transpose(" in control or "copy(" in control, control
  assert _rel(out, f32(a) @ f32(w) * np.float32(scale)) < BF16_TOLERANCE


@pytest.mark.parametrize("collective", sorted(OPS))
def test_grad_of_an_fp8_op_runs_the_bf16_kernel_backward(collective):
  """dx: the cotangent (bf16) times w.T through the other collective's
  kernel, scaled, rounded to e4m3 once; dw: the gathered operand times
  the cotangent, scaled, rounded to e4m3."""
  m, k, n = 1024, 2048, 1024
  a, w, scale = _operands(3, m, k, n, E4M3)
  t = jax.random.normal(jax.random.key(4), (m, n), jnp.float32)
  op = _op(collective)
  loss = lambda a, w: jnp.sum(op(a, w, scale).astype(jnp.float32) * t)
  value_and_grad = jax.jit(jax.value_and_grad(loss, (0, 1)))
  with jax.set_mesh(_mesh(1)):
    text = value_and_grad.lower(a, w).as_text()
    _poison(m * k * 4)
    _, (da, dw) = value_and_grad(a, w)
  # The forward's fp8 kernel and dx's bf16 one.
  assert len(re.findall(r"@mosaic_gpu", text)) == 2
  assert da.dtype == dw.dtype == E4M3
  t_bf16 = f32(t.astype(jnp.bfloat16))
  s = np.float32(scale)
  assert _rel(da, s * t_bf16 @ f32(w).T) < FP8_GRAD_TOLERANCE
  assert _rel(dw, s * f32(a).T @ t_bf16) < FP8_GRAD_TOLERANCE
