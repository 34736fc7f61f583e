"""The MaxText launcher's own flags and what it prints at the end of a run.

The summary accounts for every projection MaxText traced: which were
rewritten (with which implementation, over which mesh axis) and which were
left to MaxText or XLA, each reason said once; then the plugin's settings.
It needs no MaxText (a pure function of the decision record), so it is
tested without it.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

from absl import flags

from collective_matmul import config as config_lib
from collective_matmul import record as record_lib
from collective_matmul.enums import Collective

ALLOW_UNTESTED_VERSION = flags.DEFINE_bool(
    "maxtext_allow_untested_version", False,
    "MaxText only: run with a MaxText version the adapter was not tested with "
    "(e.g. installed from git), at your own risk, when every private MaxText "
    "function it patches has the parameters it expects; one warning names "
    "the tested version. Also: CM_MAXTEXT_ALLOW_UNTESTED_VERSION=1.")

# What to do when the plugin is on and nothing matched, by what the
# matcher said of the projections left (`nothing_rewritten_hint`): MaxText
# shards the activations between blocks on sequence over 'tensor_sequence',
# on their features over plain 'tensor', and on sequence over
# 'tensor_sequence' then 'context' with context parallelism.
NOTHING_REWRITTEN_HINT = (
    "nothing was rewritten: the collective matmul needs activations sharded "
    "on rows (sequence) over the mesh axis that shards the weights' output "
    "features, which MaxText does with tensor-sequence parallelism: set "
    "ici_tensor_sequence_parallelism > 1 (plain ici_tensor_parallelism "
    "shards the activations' features, so there is no all-gather to "
    "overlap)")
TENSOR_AXIS_HINT = (
    "nothing was rewritten: with ici_tensor_parallelism > 1 MaxText shards "
    "the activations' features over 'tensor' (a contracting dimension) and "
    "the weights over 'tensor' and 'tensor_sequence' together, which is not "
    "the collective matmul's pattern: give the 'tensor' devices to "
    "ici_tensor_sequence_parallelism (ici_tensor_parallelism=1)")
MINOR_AXIS_HINT = (
    "nothing was rewritten: the sequence is sharded over 'tensor_sequence' "
    "and then another axis (MaxText's activation_norm_length: "
    "tensor_sequence, context, context_usp_ulysses), so a device's rows are "
    "not one contiguous block of the ring's gather: the plugin serves the "
    "sequence sharded over 'tensor_sequence' alone or last (e.g. "
    "ici_context_parallelism=1)")
# (hint, what a left projection's reason says when the hint applies), the
# first that applies wins; reasons with none (quantized, excluded, ...) say
# it all themselves. A contracting dimension over 'tensor' is the hint only
# where the rows have an axis in common with the weight: tensor-sequence
# parallelism is there.
_HINTS = (
    (NOTHING_REWRITTEN_HINT,
     re.compile("no mesh axis shards both an lhs row dimension")),
    (TENSOR_AXIS_HINT,
     re.compile(r"contracting dimension \d+ is sharded over \([^)]*'tensor'")),
    (MINOR_AXIS_HINT, re.compile(r"must be the minor \(last\) axis")),
    # Plain tensor parallelism in a real MaxText run: the activations'
    # features (the contraction) sharded over 'tensor', the weights' input
    # features not. Last, so the meshes above keep their own hint.
    (NOTHING_REWRITTEN_HINT,
     re.compile("no mesh axis shards the contracting dimension of both")),
)
CONFIG_DUMP_POINTER = (
    "collective matmul: MaxText logs its whole config next ('Config param' "
    "lines on stderr; log_config=False skips them); this launcher's summary "
    "comes at the end of the run.")


def _settings(config: config_lib.CollectiveMatmulConfig) -> str:
  """`name=value` for every option but `enabled`, in declaration order."""
  parts = []
  for field in dataclasses.fields(config):
    if field.name == "enabled":
      continue
    value = getattr(config, field.name)
    if isinstance(value, (tuple, list)):
      value = ",".join(map(str, value)) or "(none)"
    parts.append(f"{field.name}={value}")
  return ", ".join(parts)


def summary(records: Sequence[record_lib.Decision],
            config: config_lib.CollectiveMatmulConfig,
            maxtext_version: str | None = None,
            attention_on: bool | None = None) -> str:
  """The launcher's last lines: projections rewritten or left, with
  reasons (each said once), and the plugin's settings."""
  head = "collective matmul summary" + (
      f" (MaxText {maxtext_version})" if maxtext_version else "") + ":"
  settings = (f"  plugin {'on' if config.enabled else 'off'}"
              + (f", {_settings(config)}" if config.enabled else "")
              + ("" if attention_on is None else
                 f"; sharded GPU flash attention "
                 f"{'on' if attention_on else 'off'}"))
  if not config.enabled:
    return "\n".join([head, settings, "  MaxText ran its own projections "
                      f"(--{config_lib.flag_name('enabled')} switches the "
                      "plugin on)"])
  # The last decision for each projection (a program traced again, e.g. an
  # eval step, decides the same way).
  latest: dict[str, record_lib.Decision] = {}
  for record in records:
    latest[record.name or "dot_general"] = record
  gradients = {n: d for n, d in latest.items()
               if n.endswith(record_lib.GRADIENT_SUFFIX)}
  projections = {n: d for n, d in latest.items() if n not in gradients}
  rewritten = {n: d for n, d in projections.items() if d.rewritten}
  left = {n: d for n, d in latest.items() if not d.rewritten}
  lines = [head,
           f"  rewritten: {len(rewritten)} of {len(projections)} projections"]
  lines += _by_how(rewritten)
  lines += _fp8_siblings(rewritten)
  if gradients:
    served = {n: d for n, d in gradients.items() if d.rewritten}
    lines.append(
        f"  and {len(served)} of {len(gradients)} gradient matmuls "
        f"(name{record_lib.GRADIENT_SUFFIX}: an fp8 projection's activation "
        "gradient, a collective matmul of its own in the backward)")
    lines += _by_how(served)
  by_reason: dict[str, list[str]] = {}
  for name, decision in left.items():
    by_reason.setdefault(decision.reason, []).append(name)
  lines.append(f"  left to MaxText / XLA: {len(left)}"
               + ("" if left else " (none)"))
  for reason, names in by_reason.items():
    lines.append(f"    {', '.join(names)}: {reason}")
  lines.append(settings)
  hint = nothing_rewritten_hint(list(latest.values()))
  if hint:
    lines.append(f"  {hint}")
  if not latest:
    lines.append("  no projection was traced with the plugin on")
  return "\n".join(lines)


def _by_how(rewritten: dict[str, record_lib.Decision]) -> list[str]:
  """One line per way of running, naming the projections run so."""
  by_how: dict[tuple[str, str], list[str]] = {}
  for name, decision in rewritten.items():
    by_how.setdefault((decision.what_runs(), decision.reason),
                      []).append(name)
  return [f"    -> {how}: {', '.join(names)}"
          + (f" ({reason})" if reason else "")
          for (how, reason), names in by_how.items()]


_ITEMSIZES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8}


def _size(n: int) -> str:
  for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= size:
      return f"{n / size:g} {unit}"
  return f"{n} B"


def _fp8_siblings(rewritten: dict[str, record_lib.Decision]) -> list[str]:
  """Why fp8 projections of one activation (attention's query, key and
  value; the MLP's wi_0 and wi_1) each gather it, with the bytes of each
  choice."""
  siblings: dict[tuple, list[str]] = {}
  for name, decision in rewritten.items():
    if (decision.dtype.startswith("e4m3") and not decision.group and
        decision.collective == Collective.ALL_GATHER and "/" in name):
      key = (name.rsplit("/", 1)[0], decision.lhs_shape, decision.dtype)
      siblings.setdefault(key, []).append(name)
  lines = []
  for (_, shape, dtype), names in siblings.items():
    if len(names) < 2:
      continue
    elements = math.prod(shape)
    wide = dtype.rsplit("-> ", 1)[-1]
    wide_bytes = elements * _ITEMSIZES.get(wide, 4)
    lines.append(
        f"    fp8 siblings not grouped: {', '.join(names)} each all-gather "
        f"their own e4m3 activation {'x'.join(map(str, shape))}, "
        f"{len(names)} x {_size(elements)} = {_size(len(names) * elements)}"
        " a step (the whole activation; each device receives (D-1)/D of "
        f"it); one grouped gather would send {_size(elements)} of e4m3 only "
        "under one scale for all, where each fp8 projection keeps its own "
        f"input scale (Flax's fp8 state), or {_size(wide_bytes)} of the "
        f"{wide} activation quantized after the gather, which the fp8 "
        "kernels do not do")
  return lines


def nothing_rewritten_hint(
    records: Sequence[record_lib.Decision]) -> str | None:
  """What to change when none of `records` was rewritten, from the reasons
  the matcher gave; None when something was, or when no hint applies."""
  if not records or any(r.rewritten for r in records):
    return None
  return next((hint for hint, says in _HINTS
               if any(says.search(r.reason) for r in records)), None)
