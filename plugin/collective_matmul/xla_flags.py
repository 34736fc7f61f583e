"""What the process environment needs before JAX starts its GPU backend for
the Hopper kernels to run: XLA_FLAGS with XLA's command buffers off (the
selection layer only reads the flags, `selection.command_buffer_reason`)."""
from __future__ import annotations

import os

from collective_matmul.selection import COMMAND_BUFFER_FLAG
from collective_matmul.selection import command_buffer_reason


def prepare_xla_for_kernels() -> bool:
  """Switches XLA's command buffers off (XLA_FLAGS), so the Hopper kernels
  may run (see `selection.command_buffer_reason`). Call before JAX starts
  its GPU backend; an explicit `--xla_gpu_enable_command_buffer=...` in
  XLA_FLAGS is left as it is.

  Returns:
    Whether XLA_FLAGS now switches command buffers off.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if COMMAND_BUFFER_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFER_FLAG}".strip()
  return command_buffer_reason("gpu") is None
