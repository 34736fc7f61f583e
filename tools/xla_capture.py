"""Which Mosaic GPU kernels XLA put inside command buffers (CUDA graphs),
read from an XLA dump (`--xla_dump_to=DIR --xla_dump_hlo_as_text`).

XLA's command-buffer scheduling pass moves each run of capturable
instructions into a computation named `command_buffer...`, called from the
schedule; a `custom_call_target="mosaic_gpu..."` inside one is a kernel XLA
records into a CUDA graph and replays. Plain text, no JAX: the GPU scripts
and their CPU tests share it.
"""
from __future__ import annotations

import os
import re

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_MOSAIC = re.compile(r'custom_call_target="mosaic_gpu[\w]*"')


def computations(hlo_text: str) -> dict[str, str]:
  """{computation name: its body} of an HLO module's text."""
  out, name, body = {}, None, []
  for line in hlo_text.splitlines():
    if name is None:
      match = _HEADER.match(line)
      if match and not line.startswith(" "):
        name, body = match.group(1), []
      continue
    if line.startswith("}"):
      out[name] = "\n".join(body)
      name = None
    else:
      body.append(line)
  return out


def captured_kernels(hlo_text: str) -> tuple[int, int]:
  """(Mosaic GPU custom calls inside command-buffer computations, those
  outside) of one module's optimized HLO."""
  inside = outside = 0
  for name, body in computations(hlo_text).items():
    count = len(_MOSAIC.findall(body))
    if name.startswith("command_buffer"):
      inside += count
    else:
      outside += count
  return inside, outside


def dump_summary(dump_dir: str, module_filter: str = "") -> dict[str, list]:
  """{module file: [kernels inside command buffers, outside]} over the
  dump's optimized modules (`*after_optimizations.txt`) whose name holds
  `module_filter` and that call a Mosaic GPU kernel."""
  out = {}
  if not os.path.isdir(dump_dir):
    return out
  for file in sorted(os.listdir(dump_dir)):
    if not file.endswith("after_optimizations.txt") or (
        module_filter not in file):
      continue
    with open(os.path.join(dump_dir, file)) as f:
      inside, outside = captured_kernels(f.read())
    if inside or outside:
      out[file] = [inside, outside]
  return out
