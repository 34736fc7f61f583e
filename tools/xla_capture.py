"""Which kernels XLA put inside command buffers (CUDA graphs), read from
an XLA dump (`--xla_dump_to=DIR`).

XLA converts runs of capturable thunks into `kCommandBuffer` thunks after
compiling (`CommandBufferConversionPass`) and dumps the result as
`*thunk_sequence_after_thunk_passes.txt` (only `*thunk_sequence.txt` when
it formed none): one line per thunk, `<indent><index>: <kind> ...`, the
thunks a command buffer records indented under it. A `kCustomCall` thunk
there is a custom call (the Mosaic GPU kernels; cuBLAS has thunks of its
own) that XLA records into a CUDA graph and replays. Plain text, no JAX:
the GPU scripts and their CPU tests share it.
"""
from __future__ import annotations

import os
import re

_THUNK = re.compile(r"^(\s*)(\d+): (\w+)")


def thunk_capture(thunk_text: str, kind: str = "kCustomCall"
                  ) -> tuple[int, int]:
  """(thunks of `kind` inside command buffers, those outside) of one
  module's thunk sequence dump."""
  inside = outside = 0
  in_command_buffer = False
  for line in thunk_text.splitlines():
    match = _THUNK.match(line)
    if not match:
      continue
    indent, _, thunk_kind = match.groups()
    if not indent:
      in_command_buffer = thunk_kind.startswith("kCommandBuffer")
    if thunk_kind.startswith(kind):
      if in_command_buffer:
        inside += 1
      else:
        outside += 1
  return inside, outside


_MOSAIC = re.compile(r'custom_call_target="mosaic_gpu\w*"')
_OPTIMIZED = "_after_optimizations.txt"
_THUNKS = ".thunk_sequence_after_thunk_passes.txt"


def dump_summary(dump_dir: str, module_filter: str = "") -> dict[str, list]:
  """{module: [custom-call thunks inside command buffers, outside]} over
  the dump's modules whose name holds `module_filter` and whose optimized
  HLO calls a Mosaic GPU kernel (a module without the thunk passes' dump
  formed no command buffer: its kernels all count as outside)."""
  out = {}
  if not os.path.isdir(dump_dir):
    return out
  files = set(os.listdir(dump_dir))
  for file in sorted(files):
    if not file.endswith(_OPTIMIZED) or module_filter not in file:
      continue
    module = file[:-len(_OPTIMIZED)]
    with open(os.path.join(dump_dir, file)) as f:
      kernels = len(_MOSAIC.findall(f.read()))
    if not kernels:
      continue
    # The thunk dumps drop the HLO file's platform suffix.
    base = module.rsplit(".sm_", 1)[0]
    thunks = next((name for name in (base + _THUNKS, module + _THUNKS)
                   if name in files), None)
    if thunks is None:
      out[module] = [0, kernels]
      continue
    with open(os.path.join(dump_dir, thunks)) as f:
      out[module] = list(thunk_capture(f.read()))
  return out
