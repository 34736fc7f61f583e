"""Collective matmul for JAX: all-gather overlapped with the matmul.

Public API:
  dot_general, logical_dot_general: drop-in `lax.dot_general` overrides.
  grouped_logical_dot_general, GroupMember: several projections of one
    activation (q/k/v, wi_0/wi_1) in one collective matmul.
  einsum, logical_einsum, mesh_axes_einsum: the same as `jnp.einsum` / einsum
    ops (Flax NNX `Einsum(einsum_op=...)`, Praxis `EinsumOp`).
  all_gather_matmul, matmul_reduce_scatter: the differentiable ops, for use
    inside `shard_map`.
  CollectiveMatmulConfig, get_config, set_config, config_context,
  config_from_flags: what the override does.
  Decision, decisions, clear_decisions, format_decisions: what it did;
    StrictFallbackError: what strict mode raises instead of a fallback.
  prepare_xla_for_kernels: XLA_FLAGS the Hopper kernels need (call before
    JAX starts its GPU backend).
  Fp8DirectDotGeneralOp, fp8_scaled_dot_general: Flax's fp8 matmul (same
    variables, same math) with its fp8 products through the drop-in; they
    import Flax, on first use.
"""
from collective_matmul.config import CollectiveMatmulConfig
from collective_matmul.config import config_context
from collective_matmul.config import get_config
from collective_matmul.config import set_config
from collective_matmul.einsum_override import einsum
from collective_matmul.einsum_override import logical_einsum
from collective_matmul.einsum_override import mesh_axes_einsum
from collective_matmul.flags import config_from_flags
from collective_matmul.grouping import GroupMember
from collective_matmul.grouping import grouped_logical_dot_general
from collective_matmul.ops import all_gather_matmul
from collective_matmul.ops import matmul_reduce_scatter
from collective_matmul.override import dot_general
from collective_matmul.override import logical_dot_general
from collective_matmul.record import Decision
from collective_matmul.record import StrictFallbackError
from collective_matmul.record import clear_decisions
from collective_matmul.record import decisions
from collective_matmul.record import format_decisions
from collective_matmul.xla_flags import prepare_xla_for_kernels

__version__ = "0.1.0"

# Names of modules that import Flax, resolved on first use.
_FP8_NAMES = ("Fp8DirectDotGeneralOp", "fp8_scaled_dot_general")


def __getattr__(name):
  if name in _FP8_NAMES:
    from collective_matmul import fp8  # pylint: disable=g-import-not-at-top
    return getattr(fp8, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
