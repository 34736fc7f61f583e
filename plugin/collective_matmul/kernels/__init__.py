"""Hopper kernels (Pallas Mosaic GPU) and their tiling.

The kernel modules, and with them Pallas Mosaic GPU, are imported on first
use of their names, so `import collective_matmul` (which reads `tuning` for
its decisions) does not import them.
"""
import importlib

# Public name -> the submodule that defines it.
_LAZY = {
    "all_gather_lhs_matmul": "all_gather_matmul",
    "matmul_reduce_scatter": "matmul_reduce_scatter_kernel",
    "AllGatherMatmulConfig": "tuning",
    "select_config": "tuning",
    "select_reduce_scatter_config": "tuning",
    "unsupported_reason": "tuning",
}
__all__ = sorted(_LAZY)


def __getattr__(name):
  if name not in _LAZY:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
  globals()[name] = value  # Found directly from now on.
  return value
