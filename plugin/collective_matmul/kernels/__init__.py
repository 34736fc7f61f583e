"""Hopper kernels (Pallas Mosaic GPU), their configs and their schedule.

Device code only, plus the pure data it needs: `configs` (the frozen
per-kernel config classes, the SM count and the operand dtype rule) and
`schedule` (the ring-schedule arithmetic the kernels trace). The two
kernels (`all_gather_matmul_kernel`, `matmul_reduce_scatter_kernel`) fill the hooks
of one skeleton, `ring_skeleton` (tile grid, persistent loop, epilogue
stores, launch and checks), whose tiles each run the k loop of `pipeline`
and reach their peers only through `peers` (devices of a mesh axis, or
virtual ranks in one launch on one GPU, `*_virtual`, to check the rings);
`tracing` records their phases on device (`trace_warpgroups`) and
`diagnostics` holds benchmark-only variants (WRONG RESULTS by design).
Nothing here imports a module of `collective_matmul` outside `kernels/`;
which kernel, which config and whether at all is decided above, in
`collective_matmul.selection`.

The kernel modules, and with them Pallas Mosaic GPU, are imported on first
use of their names, so `import collective_matmul` (which reads `configs` and
`schedule` for its decisions) does not import them.
"""
import importlib

# Public name -> the submodule that defines it.
_LAZY = {
    "all_gather_lhs_matmul": "all_gather_matmul_kernel",
    "matmul_reduce_scatter": "matmul_reduce_scatter_kernel",
    "all_gather_lhs_matmul_virtual": "all_gather_matmul_kernel",
    "matmul_reduce_scatter_virtual": "matmul_reduce_scatter_kernel",
    "VirtualRanks": "peers",
    "AllGatherConfig": "configs",
    "ReduceScatterConfig": "configs",
    "TileConfig": "configs",
    "trace_warpgroups": "tracing",
}
__all__ = sorted(_LAZY)


def __getattr__(name):
  if name not in _LAZY:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
  globals()[name] = value  # Found directly from now on.
  return value
