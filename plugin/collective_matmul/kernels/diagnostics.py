"""Benchmark-only variants of the kernels: WRONG RESULTS by design.

`loopback(kernel)` is `kernel` (`all_gather_lhs_matmul` or
`matmul_reduce_scatter`) with every device sending to its own scratch
instead of its ring neighbour's: the kernel does the same work, its waits
included, without NVLink traffic, so that timing it against the real
kernel shows what the link costs. For D > 1 its results are wrong (each
device reads back its own shard or partial sum); never use it for numbers
that matter. The kernels' public signatures have no such switch.

Pure Python: nothing here imports JAX or Pallas.
"""
from __future__ import annotations

import contextvars
import functools
from typing import Callable, TypeVar

_Kernel = TypeVar("_Kernel", bound=Callable)

# Read by the kernels when they are traced (`loopback_active`).
_LOOPBACK: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "collective_matmul_loopback", default=False)


def loopback(kernel: _Kernel) -> _Kernel:
  """`kernel` in loopback: WRONG RESULTS for D > 1 (see the module).

  The returned function takes `kernel`'s arguments and traces `kernel`
  with every device as its own peer; the switch holds only while it runs,
  so a function traced with `kernel` itself (or jitted before) is not
  affected, and one traced with the returned function stays in loopback
  whenever JAX reuses that trace.
  """

  @functools.wraps(kernel)
  def in_loopback(*args, **kwargs):
    token = _LOOPBACK.set(True)
    try:
      return kernel(*args, **kwargs)
    finally:
      _LOOPBACK.reset(token)

  return in_loopback  # type: ignore[return-value]


def loopback_active() -> bool:
  """Whether the kernel being traced is in `loopback` (the kernels read it
  as they are traced)."""
  return _LOOPBACK.get()
