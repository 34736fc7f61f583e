"""What the process environment needs before JAX starts its GPU backend for
the Hopper kernels to run: XLA_FLAGS whose command buffers the kernels are
safe under (the selection layer only reads the flags,
`selection.command_buffer_reason`)."""
from __future__ import annotations

import os

from collective_matmul.selection import COMMAND_BUFFER_FLAG
from collective_matmul.selection import command_buffer_reason


def prepare_xla_for_kernels() -> bool:
  """Leaves XLA_FLAGS as they are where the kernels may run under them;
  else (a JAX whose kernels are not checked under CUDA-graph capture)
  takes custom calls out of XLA's command buffers
  (`--xla_gpu_enable_command_buffer=-CUSTOM_CALL`, XLA's other graphs
  kept). Call before JAX starts its GPU backend.

  Returns:
    Whether the kernels may run under XLA_FLAGS now.
  """
  if command_buffer_reason("gpu") is None:
    return True
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFER_FLAG}-CUSTOM_CALL".strip()
  return command_buffer_reason("gpu") is None
