"""The owners of the projection being traced: a per-thread stack of frames.

Each patched owner (`MlpBlock`, `Attention`, the decoder's output head, MoE
blocks, the models' own layers, `DenseGeneral` itself) pushes a `Frame` for
its call, so the dot_general of a DenseGeneral knows which projection it is
(`projection_name`), in which model mode, and what its owner holds.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator

from collective_matmul.integrations.maxtext import quantization

TRAIN = "train"  # maxtext.common.common_types.MODEL_MODE_TRAIN

# Per thread: `stack`, the frames; `captured`, the calls a sibling group's
# capture collects (`siblings.capture_call`); `decoder_mode`, gemma4_small's
# layers' model mode (for its per-layer inputs' projection).
local = threading.local()


@dataclasses.dataclass
class Frame:
  # "mlp", "attention", "decoder", "moe", "gate", "layer" (gemma4_small's
  # decoder layer, which owns projections itself), "qwen3_custom_layer",
  # "linear_attention" (qwen3-next's Gated DeltaNet), "shared_moe"
  # (qwen3-next's MoE block with its shared expert), "per_layer_embedder"
  # (gemma4_small's per-layer inputs) or "dense".
  kind: str
  module: Any
  model_mode: str | None = None
  # The first part of the names of the projections it owns (default: the
  # kind). "layer": named only when it is the innermost owner.
  label: str = ""
  # "dense": the array DenseGeneral was called with.
  inputs: Any = None
  # "attention": called with inputs_q is inputs_kv and no shared key/value,
  # so query, key and value project the same array.
  self_attention: bool = False
  # Owners: results of a sibling group for the later siblings' dots, by
  # attribute name: (result, the call it was computed for, the array the
  # first sibling's DenseGeneral was called with).
  group_results: dict[str, tuple[Any, Any, Any]] = (
      dataclasses.field(default_factory=dict))
  group_reason: str = ""  # Owners: why the siblings were not grouped.

  @property
  def prefix(self) -> str:
    return self.label or self.kind


def stack() -> list[Frame]:
  if not hasattr(local, "stack"):
    local.stack = []
  return local.stack


@contextlib.contextmanager
def entered(frame: Frame) -> Iterator[None]:
  frames = stack()
  frames.append(frame)
  try:
    yield
  finally:
    frames.pop()


def attribute_name(owner, module) -> str | None:
  return next((k for k, v in getattr(owner, "__dict__", {}).items()
               if v is module), None)


def projection_name(owners, module) -> str | None:
  """`module`'s name: the outermost owner's kind, the attribute of each
  nested owner of another kind in the one around it, and `module`'s
  attribute in the innermost ("mlp/wi_0"; a mixture-of-experts block's
  shared experts: "moe/shared_experts/wi_0"); None when the innermost owner
  does not hold it."""
  # A decoder layer names only the projections it owns itself.
  owners = [f for f in owners[:-1] if f.prefix != "layer"] + owners[-1:]
  if not owners:
    return None
  parts = [owners[0].prefix]
  for outer, inner in zip(owners, owners[1:]):
    if inner.prefix != outer.prefix:
      parts.append(attribute_name(outer.module, inner.module) or inner.kind)
  attr = attribute_name(owners[-1].module, module)
  return "/".join(parts + [attr]) if attr else None


def qwix_mode(frames) -> quantization.QwixMode | None:
  """The Qwix quantization of the innermost module's dot_general, or None;
  its owners' MaxText config names the mode."""
  return quantization.qwix_mode(
      getattr(f.module, "config", None) for f in reversed(frames))
