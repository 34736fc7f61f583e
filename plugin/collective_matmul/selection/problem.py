"""The per-shard problem every selection rule reads (`Problem`)."""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from collective_matmul.kernels import configs

_SHORT_DTYPE_NAMES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2",
                      "bfloat16": "bf16", "float16": "f16",
                      "float32": "f32", "float64": "f64"}


def short_dtype_name(dtype) -> str:
  """`e4m3`, `bf16`, `f32`, ...: a dtype as the decision record names it."""
  name = np.dtype(dtype).name
  return _SHORT_DTYPE_NAMES.get(name, name)


def dtype_label(lhs_dtype, rhs_dtype, out_dtype=None) -> str:
  """The dtypes as the decision record and the plan name them: both
  operands' for fp8 or differing ones, one otherwise, then the result's
  where given and not the one operands' (`e4m3 x e4m3 -> bf16`, `bf16`,
  `bf16 -> f32`)."""
  lhs, rhs = np.dtype(lhs_dtype), np.dtype(rhs_dtype)
  if lhs == rhs and not configs.is_fp8(lhs):
    operands = short_dtype_name(lhs)
    shown = out_dtype is not None and np.dtype(out_dtype) != lhs
  else:
    operands = f"{short_dtype_name(lhs)} x {short_dtype_name(rhs)}"
    shown = out_dtype is not None
  return (f"{operands} -> {short_dtype_name(out_dtype)}" if shown
          else operands)


def wider_dtype(a, b) -> np.dtype:
  """The wider of two dtypes, in which a cotangent meets a weight. JAX
  promotes no fp8 dtype implicitly: one meets another dtype as that dtype
  (exactly: every fp8 value is a bf16 value), and another fp8 dtype as
  float32."""
  a, b = jnp.dtype(a), jnp.dtype(b)
  if configs.is_fp8(a):
    a = jnp.dtype(jnp.float32) if configs.is_fp8(b) else b
  if configs.is_fp8(b):
    b = a
  return np.dtype(jnp.promote_types(a, b))


class Problem(NamedTuple):
  """The per-shard 2-D problem a kernel sees.

  rows: the activation shard's rows (before the all-gather, after the
  reduce-scatter); k: the local contraction; n: the local output columns;
  dtype: the activation's (lhs) operand dtype; axis_size: the devices of
  the ring; out_dtype: the result's, None for the operands'; rhs_dtype: the
  weight's, None for `dtype` (fp8 pairs differ: an e5m2 gradient times an
  e4m3 weight); rows_per_batch: the run of rows per leading index where
  the activation is split on a dimension other than its first (`[b, s, k]`
  on `s`: `plan.kernel_rows`), None where it is split on the first;
  rowwise: the product is scaled per row and per column (rowwise fp8: the
  ops' `row_scale` / `col_scale`), not only by one scale per tensor.
  """

  rows: int
  k: int
  n: int
  dtype: np.dtype
  axis_size: int
  out_dtype: np.dtype | None = None
  rhs_dtype: np.dtype | None = None
  rows_per_batch: int | None = None
  rowwise: bool = False

  @property
  def operand_dtypes(self) -> tuple[np.dtype, np.dtype]:
    """(lhs, rhs) operand dtypes."""
    return (np.dtype(self.dtype),
            np.dtype(self.dtype if self.rhs_dtype is None
                     else self.rhs_dtype))

  @property
  def is_fp8(self) -> bool:
    """Either operand is an 8-bit float."""
    return any(configs.is_fp8(d) for d in self.operand_dtypes)

  @property
  def result_dtype(self) -> np.dtype:
    """The result's dtype: `out_dtype`, else the operands' (an fp8 product
    without one would be fp8, which no kernel writes)."""
    return np.dtype(self.out_dtype or self.dtype)

  @property
  def itemsizes(self) -> tuple[int, int]:
    """Bytes of an operand element and of a result element."""
    return (np.dtype(self.dtype).itemsize, self.result_dtype.itemsize)

  def dtype_label(self) -> str:
    """`dtype_label` of the operands and the result, then "rowwise" for a
    rowwise-scaled product (`e4m3 x e4m3 -> f32 rowwise`)."""
    label = dtype_label(*self.operand_dtypes, self.result_dtype)
    return f"{label} rowwise" if self.rowwise else label

  def backward(self) -> Problem:
    """The backward's problem (dx of the other collective), as the op's
    backward runs it (`primitives`): the cotangent (this result's dtype)
    times w.T, both in the wider of the cotangent's and the weight's dtypes
    (an fp8 weight meets a bf16 cotangent as bf16), written in the
    activation's dtype, or for an fp8 activation in that wider dtype (its
    gradient is rounded to fp8 once, after the collective); its rows and
    their runs are this problem's, and it is rowwise where this one is
    (its rows take the row scales)."""
    lhs, rhs = self.operand_dtypes
    dtype = wider_dtype(self.result_dtype, rhs)
    out = dtype if configs.is_fp8(lhs) else lhs
    return Problem(self.rows, self.n, self.k, dtype, self.axis_size, out,
                   rows_per_batch=self.rows_per_batch, rowwise=self.rowwise)
