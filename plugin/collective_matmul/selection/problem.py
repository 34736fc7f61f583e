"""The per-shard problem every selection rule reads (`Problem`)."""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np


class Problem(NamedTuple):
  """The per-shard 2-D problem a kernel sees.

  rows: the activation shard's rows (before the all-gather, after the
  reduce-scatter); k: the local contraction; n: the local output columns;
  dtype: the operands'; axis_size: the devices of the ring; out_dtype: the
  result's, None for the operands'.
  """

  rows: int
  k: int
  n: int
  dtype: np.dtype
  axis_size: int
  out_dtype: np.dtype | None = None

  @property
  def itemsizes(self) -> tuple[int, int]:
    """Bytes of an operand element and of a result element."""
    return (np.dtype(self.dtype).itemsize,
            np.dtype(self.out_dtype or self.dtype).itemsize)

  def backward(self) -> Problem:
    """The backward's problem (dx of the other collective): the cotangent
    (this result's dtype, widened to meet the weight's) times w.T, written
    in the operands' dtype."""
    dtype = jnp.promote_types(self.out_dtype or self.dtype, self.dtype)
    return Problem(self.rows, self.n, self.k, np.dtype(dtype),
                   self.axis_size, np.dtype(self.dtype))
