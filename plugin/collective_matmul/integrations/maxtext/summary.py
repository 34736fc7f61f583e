"""The MaxText launcher's own flags and what it prints at the end of a run.

The summary accounts for every projection MaxText traced: which were
rewritten (with which implementation, over which mesh axis) and which were
left to MaxText or XLA, each reason said once; then the plugin's settings.
It needs no MaxText (a pure function of the decision record), so it is
tested without it.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from absl import flags

from collective_matmul import config as config_lib
from collective_matmul import record as record_lib

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
  rewritten = {n: d for n, d in latest.items() if d.rewritten}
  left = {n: d for n, d in latest.items() if not d.rewritten}
  lines = [head,
           f"  rewritten: {len(rewritten)} of {len(latest)} projections"]
  by_how: dict[tuple[str, str], list[str]] = {}
  for name, decision in rewritten.items():
    by_how.setdefault((decision.what_runs(), decision.reason),
                      []).append(name)
  for (how, reason), names in by_how.items():
    lines.append(f"    -> {how}: {', '.join(names)}"
                 + (f" ({reason})" if reason else ""))
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


def nothing_rewritten_hint(
    records: Sequence[record_lib.Decision]) -> str | None:
  """What to change when none of `records` was rewritten, from the reasons
  the matcher gave; None when something was, or when no hint applies."""
  if not records or any(r.rewritten for r in records):
    return None
  return next((hint for hint, says in _HINTS
               if any(says.search(r.reason) for r in records)), None)
