"""Warpgroup traces (diagnostics): the kernels' phases recorded on device
by Mosaic GPU's profiler, switched on for the kernels traced inside
`trace_warpgroups`."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, NamedTuple

import jax


class _Trace(NamedTuple):
  dump_dir: str
  ranges: int


_TRACE: contextvars.ContextVar[_Trace | None] = contextvars.ContextVar(
    "collective_matmul_trace", default=None)
# Shared memory of one traced range: 2 events of 2 words, per warpgroup.
TRACE_BYTES_PER_RANGE = 3 * 2 * 2 * 4


@contextlib.contextmanager
def trace_warpgroups(dump_dir: str, ranges_per_warpgroup: int = 64):
  """Diagnostics: kernels traced (jitted) inside this context record, on
  every block and warpgroup, when each of the skeleton's phases (`PHASES`)
  begins and ends, with Mosaic GPU's on-device profiler, and their calls
  write Chrome traces (`*-trace.json`) into `dump_dir`: JAX 0.12 one per
  call; JAX 0.11 one per kernel name, not overwritten, so only the first
  call's (of the first device) is kept. Times in the trace are SM clock
  cycles from the block's first event (`ts` in "us" is the block's global
  start time in ns plus those cycles, over 1000);
  tools/warpgroup_trace.py reads them.

  A range costs `TRACE_BYTES_PER_RANGE` bytes of shared memory, counted in
  the kernels' shared-memory check. A warpgroup that records more ranges
  than `ranges_per_warpgroup` writes past its buffer into shared memory
  next to it, so size it for the most tiles a block runs (the benchmark
  scripts take 2-3 per tile, plus 4). Re-jit to trace: a function traced
  outside the context stays untraced.
  """
  if ranges_per_warpgroup < 1:
    raise ValueError(f"{ranges_per_warpgroup=} must be >= 1")
  token = _TRACE.set(_Trace(str(dump_dir), int(ranges_per_warpgroup)))
  try:
    yield
  finally:
    _TRACE.reset(token)


def trace_smem_bytes() -> int:
  """Shared memory the active `trace_warpgroups` adds per block (0 off)."""
  trace = _TRACE.get()
  return trace.ranges * TRACE_BYTES_PER_RANGE if trace else 0


# The phases a traced kernel records: a tile's k loop and epilogue on each
# compute warpgroup, and the collectives' waits.
PHASES = ("mma", "epilogue", "wait_arrival", "wait_partial_sum")


def phase(name: str):
  """A traced phase (`with phase("mma"): ...`): a `jax.named_scope`, which
  Mosaic GPU's profiler records as a range; costs nothing untraced."""
  if name not in PHASES:
    raise ValueError(f"phase {name!r} is not one of {PHASES}")
  return jax.named_scope(name)


def profiler_params() -> dict[str, Any]:
  """The on-device profiler's compiler params of the active
  `trace_warpgroups` ({} outside it)."""
  trace = _TRACE.get()
  if trace is None:
    return {}
  return dict(profile_space=trace.ranges, profile_dir=trace.dump_dir)
