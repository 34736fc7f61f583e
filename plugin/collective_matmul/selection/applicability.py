"""Whether the Hopper kernels may serve a problem, and whether they pay off.

Every rule here takes the facts and, where it needs one, the config that
would run; none picks a config. Each returns a reason (a sentence for the
decision record) or None. The rules depend only on global facts (platform,
device kind, dtype, per-shard sizes, XLA flags, process layout), so every
process of a job answers the same.
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple

import numpy as np

from collective_matmul.kernels import configs
from collective_matmul.kernels.schedule import padding
from collective_matmul.selection.device import DeviceFacts
from collective_matmul.selection.problem import Problem


def unsupported_reason(problem: Problem, device: DeviceFacts) -> str | None:
  """Why the Hopper kernels cannot serve `problem` on `device`, or None if
  they can."""
  if device.platform not in ("gpu", "cuda"):
    return f"backend is {device.platform!r}, the kernel needs a CUDA GPU"
  if not device.is_hopper:
    return f"device {device.device_kind!r} is not a Hopper (sm_90a) GPU"
  reason = operand_reason(problem) or scales_reason(problem)
  if reason is not None:
    return reason
  if min(problem.rows, problem.k, problem.n) <= 0:
    return (f"empty problem m={problem.rows} k={problem.k} "
            f"n={problem.n}")
  if problem.axis_size < 1:
    return f"axis size {problem.axis_size}"
  return None


def _jax_version() -> tuple[int, int]:
  import jax  # pylint: disable=g-import-not-at-top
  return tuple(int(x) for x in jax.__version__.split(".")[:2])


# What the collective matmuls take (any implementation): one 16-, 32- or
# 64-bit float, or fp8 operands in any pair (Flax's fp8 matmuls: e4m3 x
# e4m3 forward, the e5m2 gradient times an e4m3 operand backward) with a
# wider result.
SERVED_DTYPES = ("float32", "bfloat16", "float16", "float64")


def served_dtype_reason(lhs_dtype, rhs_dtype, preferred_element_type
                        ) -> str | None:
  """Why no collective matmul takes these operands (the drop-in leaves
  them to XLA), or None."""
  lhs, rhs = np.dtype(lhs_dtype), np.dtype(rhs_dtype)
  if configs.is_fp8(lhs) and configs.is_fp8(rhs):
    if preferred_element_type is None:
      return ("fp8 operands without preferred_element_type (an fp8 "
              "result)")
    return None
  if rhs != lhs:
    return f"operand dtypes differ: lhs {lhs}, rhs {rhs}"
  if lhs.name not in SERVED_DTYPES:
    return f"unsupported dtype {lhs}"
  return None


def operand_reason(problem: Problem) -> str | None:
  """Why the kernels cannot take `problem`'s operand and result dtypes, or
  None: bf16 or f16 operands of one dtype (results in theirs or float32);
  or an fp8 pair the wgmma takes (`configs.FP8_PAIRS`: e4m3 x e4m3, e5m2 x
  e4m3) with bf16 or float32 results, the weight passed K-major (the
  dispatch does) in k steps of `configs.FP8_TILE_K` (`config_reason`)."""
  lhs, rhs = problem.operand_dtypes
  if not problem.is_fp8:
    if lhs != rhs:
      return f"operand dtypes differ: lhs {lhs.name}, rhs {rhs.name}"
    return configs.dtype_reason(lhs, problem.out_dtype)
  if problem.out_dtype is None:
    return (f"fp8 operands {lhs.name} x {rhs.name} with an fp8 result (the "
            "kernels give bfloat16 or float32)")
  reason = configs.fp8_reason(lhs, rhs, problem.out_dtype, True,
                              configs.FP8_TILE_K)
  if reason is not None:
    return reason
  if lhs != rhs and _jax_version() < (0, 11):
    return (f"fp8 operands {lhs.name} x {rhs.name} need JAX >= 0.11 (the "
            "wgmma of this JAX takes one dtype)")
  return None


def scales_reason(problem: Problem) -> str | None:
  """Why the kernels may not apply `problem`'s scales, or None: row and
  column scales (rowwise) are served with fp8 operands, the pairs the
  kernels ran with them on a GPU (e4m3 x e4m3, e5m2 x e4m3:
  benchmarks/rowwise_one_gpu/); with other operands they have run only in
  Mosaic GPU's interpret mode."""
  if problem.rowwise and not problem.is_fp8:
    return ("row and column scales with non-fp8 operands: not served by "
            "the Hopper kernels (they have run on a GPU with fp8 operands "
            "only)")
  return None


def config_reason(config: configs.TileConfig,
                  problem: Problem) -> str | None:
  """Why the kernels cannot run `problem` with `config`, or None: fp8
  operands need k steps of `configs.FP8_TILE_K`, and the pipeline and
  epilogue must fit a block's shared memory at the problem's element
  sizes."""
  if problem.is_fp8 and config.tile_k != configs.FP8_TILE_K:
    lhs, rhs = problem.operand_dtypes
    return configs.fp8_reason(lhs, rhs, problem.out_dtype, True,
                              config.tile_k)
  needed = config.smem_bytes(*problem.itemsizes)
  if needed > configs.SMEM_BYTES:
    return (f"the config needs {needed} bytes of shared memory with "
            f"{problem.dtype_label()} (a block has {configs.SMEM_BYTES})")
  return None


COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer="
# XLA's default `--xla_gpu_enable_command_buffer` set
# (`DefaultDebugOptionsIgnoringFlags`, the XLA of JAX 0.10-0.12).
DEFAULT_COMMAND_BUFFER_TYPES = frozenset(
    {"FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN",
     "DYNAMIC_SLICE_FUSION"})
# The JAX versions (major, minor) on which the kernels were checked correct
# with XLA capturing them in CUDA graphs and replaying them (both kernels,
# bf16 and fp8, forward and backward, virtual ranks and two processes over
# NCCL's peer path; docs/TUNING.md, "Command buffers").
CAPTURE_CHECKED_JAX = ((0, 11), (0, 12))
_FLAG_VALUES = re.compile(r"(?:^|\s)" + re.escape(COMMAND_BUFFER_FLAG) +
                          r"(\"[^\"]*\"|'[^']*'|\S*)")
_TYPE_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


def _apply_command_buffer_value(types: set[str], value: str) -> set[str]:
  """`types` after one `--xla_gpu_enable_command_buffer=value`, as XLA's
  repeated-enum flag reads it: empty clears the set; a list of names
  replaces it; a list of +NAME / -NAME adds to or removes from it; a list
  that mixes the two is refused (XLA refuses it too)."""
  if value == "":
    return set()
  items = value.split(",")
  names = [item.strip() for item in items]
  modifiers = [name for name in names if name[:1] in ("+", "-")]
  if modifiers and len(modifiers) != len(items):
    raise ValueError(
        f"XLA_FLAGS {COMMAND_BUFFER_FLAG}{value}: all values must be "
        "incremental (+NAME, -NAME) or none of them (XLA's rule)")
  out = set(types) if modifiers else set()
  for name in names:
    if not name:
      continue
    op, name = (name[0], name[1:]) if name[0] in "+-" else ("+", name)
    name = name.upper()
    if not _TYPE_NAME.fullmatch(name):
      raise ValueError(
          f"XLA_FLAGS {COMMAND_BUFFER_FLAG}{value}: {name!r} is no command "
          "type name (comma-separated names such as FUSION, CUBLAS, "
          "CUSTOM_CALL; +NAME / -NAME to change XLA's default set; empty "
          "for none)")
    if op == "+":
      out.add(name)
    else:
      out.discard(name)
  return out


def command_buffer_types(xla_flags: str | None = None) -> frozenset[str]:
  """The command types XLA records into CUDA graphs under `xla_flags`
  (default: XLA_FLAGS of the process environment): XLA's default set
  changed by each `--xla_gpu_enable_command_buffer=` in order.

  Raises:
    ValueError: a value XLA would refuse (a mix of +NAME and NAME, or no
      type name), naming it.
  """
  flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  types = set(DEFAULT_COMMAND_BUFFER_TYPES)
  for value in _FLAG_VALUES.findall(flags):
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
      value = value[1:-1]
    types = _apply_command_buffer_value(types, value)
  return frozenset(types)


def command_buffer_reason(platform: str, xla_flags: str | None = None,
                          jax_version: tuple[int, int] | None = None
                          ) -> str | None:
  """Why XLA's command buffers make the kernels unsafe here, or None.

  XLA on GPU records runs of thunks into CUDA graphs and replays them; with
  CUSTOM_CALL in its set (the default) the kernels are recorded too. They
  run only where that was checked correct (`CAPTURE_CHECKED_JAX`), or
  where XLA captures no custom call.
  `xla_flags`: XLA_FLAGS (default: the process environment, the same on
  every process of a job); `jax_version`: (major, minor), default the
  running JAX's.

  Raises:
    ValueError: a malformed `--xla_gpu_enable_command_buffer` value.
  """
  if platform not in ("gpu", "cuda"):
    return None
  if "CUSTOM_CALL" not in command_buffer_types(xla_flags):
    return None
  version = _jax_version() if jax_version is None else tuple(jax_version)
  if version in CAPTURE_CHECKED_JAX:
    return None
  checked = ", ".join(f"{a}.{b}" for a, b in CAPTURE_CHECKED_JAX)
  return (f"XLA command buffers (CUDA graphs) capture custom calls, and the "
          f"kernels under graph capture are checked on JAX {checked} only "
          f"(this is JAX {version[0]}.{version[1]}): set XLA_FLAGS="
          f"{COMMAND_BUFFER_FLAG}-CUSTOM_CALL to use them")


# The first NCCL whose `ncclGetPeerDevicePointer` gives the kernels their
# peers' memory across processes (2.28.9 fails with "unhandled system
# error"; BUILD.md, docs/TUNING.md "Process layout").
PEER_POINTER_NCCL = (2, 29, 2)


def process_layout_reason(problem: Problem,
                          device: DeviceFacts) -> str | None:
  """Why the ring's devices cannot run the kernels as the program's
  processes own them, or None.

  With a ring over devices of several processes the kernel reaches its
  peers through NCCL's `ncclGetPeerDevicePointer`, which works from NCCL
  `PEER_POINTER_NCCL` on; `device.nccl_version` is the lowest version the
  job's processes loaded, so every process answers the same. One process
  owning every device of the ring needs no NCCL peer pointer.
  """
  axis_size = problem.axis_size
  if device.process_count <= 1 or device.local_device_count >= axis_size:
    return None
  if device.nccl_version is not None and (
      device.nccl_version >= PEER_POINTER_NCCL):
    return None
  found = ("NCCL version unknown" if device.nccl_version is None
           else "NCCL " + ".".join(map(str, device.nccl_version)))
  need = ".".join(map(str, PEER_POINTER_NCCL))
  return (f"the ring over {axis_size} devices spans several processes "
          f"({device.process_count} processes of "
          f"{device.local_device_count} devices), which needs NCCL >= "
          f"{need} on every process ({found}): pip install "
          '"nvidia-nccl-cu13>=2.30", or give each process every GPU of its '
          "ring")


class SmallBox(NamedTuple):
  """Per-shard problems (rows, local contraction k, local columns n) where
  overlapping pays at D = 2 although a ring step has few tiles."""

  min_rows: int
  k_range: tuple[int, int]
  min_n: int

  def holds(self, problem: Problem) -> bool:
    low, high = self.k_range
    return (problem.rows >= self.min_rows and low <= problem.k <= high
            and problem.n >= self.min_n)

  def __str__(self):
    low, high = self.k_range
    return (f"from {self.min_rows} rows with k {low}-{high} and "
            f"n >= {self.min_n}")


# At D = 2 the all-gather's dedicated senders and the reduce-scatter's
# concurrent ring steps hide the transfer even when a step has few tiles,
# inside these boxes (their edges: docs/TUNING.md, "Small problems").
SMALL_BOXES = (SmallBox(128, (2048, 8192), 2048),
               SmallBox(256, (1024, 14336), 1024))


def tiles_per_step(config: configs.TileConfig, problem: Problem) -> int:
  """Output tiles of `config` in one ring step of `problem`'s per-shard
  result (rows x n)."""
  m, n = problem.rows, problem.n
  pad = padding(config, m, 0, n)
  return ((m + pad.m) // config.cta_tile_m) * ((n + pad.n) // config.cta_tile_n)


def too_small_reason(config: configs.TileConfig, problem: Problem,
                     num_sms: int) -> str | None:
  """Why overlapping does not pay for `problem` run with `config`, or None
  if it does.

  When one ring step has too few output tiles to keep half the SMs busy,
  each step's tiles wait on the previous step's data with the GPU mostly
  idle, and an NCCL collective with one cuBLAS GEMM is faster; except at
  D = 2 inside `SMALL_BOXES`.
  """
  per_step = tiles_per_step(config, problem)
  axis_size = problem.axis_size
  if axis_size == 1 or per_step >= num_sms / 2:
    return None
  if axis_size == 2 and any(box.holds(problem) for box in SMALL_BOXES):
    return None
  where = ("; at D = 2 measured faster "
           + " or ".join(map(str, SMALL_BOXES)) if axis_size == 2 else "")
  return (f"only {per_step} output tiles per ring step for {num_sms} SMs "
          f"(local {problem.rows}x{problem.k}x{problem.n}{where}): the "
          "collective + GEMM is faster")
