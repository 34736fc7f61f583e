"""Which implementation serves a collective matmul, and with which config.

The layer between the kernels and the ops, one module per role:

* `problem`: the per-shard problem (`Problem`) every rule takes whole;
* `device`: the machine's facts (`DeviceFacts`), read once per decision;
* `applicability`: whether the kernels may run and whether they pay off,
  for given facts and a given config (never picking one);
* `heuristics`: what is tried and how a config is picked where nothing
  measured applies;
* `tuned`: the measured configs (per-host autotune cache, packaged table);
* `decide`: `choose`, the one decision, returning a `plan.KernelPlan`
  (forward and backward implementation, config and its source, the
  operands' layouts, the reason).

Pure Python: it reads `kernels.configs` and `kernels.schedule` (no Pallas),
so `import collective_matmul` does not import Mosaic GPU. The decision
depends only on global facts (platform, device kind, dtype, per-shard sizes,
flags), so every process answers the same.
"""
from __future__ import annotations

from collective_matmul.kernels.configs import AllGatherConfig
from collective_matmul.kernels.configs import KERNEL_DTYPES
from collective_matmul.kernels.configs import ReduceScatterConfig
from collective_matmul.kernels.configs import SMEM_BYTES
from collective_matmul.kernels.configs import is_fp8
from collective_matmul.kernels.schedule import padding
from collective_matmul.kernels.schedule import supports_rows_per_batch
from collective_matmul.plan import KernelPlan
from collective_matmul.plan import config_label
from collective_matmul.enums import Collective
from collective_matmul.selection.applicability import CAPTURE_CHECKED_JAX
from collective_matmul.selection.applicability import COMMAND_BUFFER_FLAG
from collective_matmul.selection.applicability import PEER_POINTER_NCCL
from collective_matmul.selection.applicability import SMALL_BOXES
from collective_matmul.selection.applicability import command_buffer_reason
from collective_matmul.selection.applicability import command_buffer_types
from collective_matmul.selection.applicability import config_reason
from collective_matmul.selection.applicability import operand_reason
from collective_matmul.selection.applicability import process_layout_reason
from collective_matmul.selection.applicability import scales_reason
from collective_matmul.selection.applicability import served_dtype_reason
from collective_matmul.selection.applicability import tiles_per_step
from collective_matmul.selection.applicability import too_small_reason
from collective_matmul.selection.applicability import unsupported_reason
from collective_matmul.selection.decide import CALLER
from collective_matmul.selection.decide import HEURISTIC
from collective_matmul.selection.decide import Options
from collective_matmul.selection.decide import choose
from collective_matmul.selection.decide import config_for
from collective_matmul.selection.decide import heuristic_config
from collective_matmul.selection.device import DeviceFacts
from collective_matmul.selection.device import HOPPER_DEVICE_KINDS
from collective_matmul.selection.device import job_nccl_version
from collective_matmul.selection.device import loaded_nccl_version
from collective_matmul.selection.device import device_facts
from collective_matmul.selection.problem import Problem
from collective_matmul.selection.problem import dtype_label
from collective_matmul.selection.problem import short_dtype_name
from collective_matmul.selection.problem import wider_dtype
from collective_matmul.selection.heuristics import SENDER_SMS
from collective_matmul.selection.heuristics import SENDER_WIDE_TILE_K
from collective_matmul.selection.heuristics import tile_candidates
from collective_matmul.selection.heuristics import wide_sender_tiles
from collective_matmul.selection.tuned import AUTOTUNE_CACHE
from collective_matmul.selection.tuned import CACHE_COLLECTIVES
from collective_matmul.selection.tuned import PACKAGED_TABLE
from collective_matmul.selection.tuned import TUNED_CONFIGS_FILE
from collective_matmul.selection.tuned import cache_key
from collective_matmul.selection.tuned import cache_path
from collective_matmul.selection.tuned import load_cached_config
from collective_matmul.selection.tuned import packaged_config
from collective_matmul.selection.tuned import packaged_table
from collective_matmul.selection.tuned import parse_tuned_configs
from collective_matmul.selection.tuned import store_cached_config


def select_config(m: int, k: int, n: int, dtype, axis_size: int,
                  device: DeviceFacts | None = None,
                  out_dtype=None, rhs_dtype=None) -> AllGatherConfig:
  """The all-gather kernel's config for local shards `m x k` and `k x n` on
  `device` (default: the default backend's): `config_for`'s of that
  `Problem` (`rhs_dtype`: the weight's, None for `dtype`), without its
  source."""
  problem = Problem(m, k, n, dtype, axis_size, out_dtype, rhs_dtype)
  return config_for(Collective.ALL_GATHER, problem,
                    device or device_facts())[0]


def select_reduce_scatter_config(m: int, k: int, n: int, dtype,
                                 axis_size: int,
                                 device: DeviceFacts | None = None,
                                 out_dtype=None,
                                 rhs_dtype=None) -> ReduceScatterConfig:
  """The reduce-scatter kernel's config (m: rows after the scatter), as
  `select_config`."""
  problem = Problem(m, k, n, dtype, axis_size, out_dtype, rhs_dtype)
  return config_for(Collective.REDUCE_SCATTER, problem,
                    device or device_facts())[0]


__all__ = [
    "AllGatherConfig", "ReduceScatterConfig", "KERNEL_DTYPES", "SMEM_BYTES",
    "is_fp8",
    "padding", "supports_rows_per_batch",
    "DeviceFacts", "HOPPER_DEVICE_KINDS", "device_facts",
    "loaded_nccl_version", "job_nccl_version",
    "COMMAND_BUFFER_FLAG", "CAPTURE_CHECKED_JAX", "PEER_POINTER_NCCL",
    "SMALL_BOXES", "unsupported_reason", "operand_reason", "scales_reason",
    "config_reason", "command_buffer_reason", "command_buffer_types",
    "process_layout_reason",
    "tiles_per_step", "too_small_reason",
    "SENDER_SMS", "SENDER_WIDE_TILE_K", "tile_candidates",
    "wide_sender_tiles",
    "AUTOTUNE_CACHE", "PACKAGED_TABLE", "CACHE_COLLECTIVES",
    "TUNED_CONFIGS_FILE", "cache_path", "cache_key", "load_cached_config",
    "store_cached_config", "parse_tuned_configs", "packaged_table",
    "packaged_config",
    "CALLER", "HEURISTIC", "Problem", "dtype_label", "short_dtype_name",
    "wider_dtype", "served_dtype_reason",
    "Options", "KernelPlan", "choose",
    "config_for", "config_label", "heuristic_config", "select_config",
    "select_reduce_scatter_config",
]
