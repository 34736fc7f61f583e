"""The plugin's configuration: one frozen object, and the active one.

The drop-in `dot_general` reads the *active* configuration at trace time (it is
a property of the program being traced, like a mesh). Library users build a
`CollectiveMatmulConfig` in code; absl users get one from `config_from_flags()`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import fnmatch
from typing import Callable, Iterator

from collective_matmul.enums import Impl

IMPLEMENTATIONS = tuple(impl.value for impl in Impl)
FALLBACK_IMPLEMENTATIONS = (Impl.RING.value, Impl.BASELINE.value)


@dataclasses.dataclass(frozen=True)
class CollectiveMatmulConfig:
  """What the drop-in `dot_general` does with the collective-matmul pattern.

  Attributes:
    enabled: rewrite detected patterns at all. Off: `dot_general` is exactly
      `lax.dot_general`.
    impl: `auto` (the Hopper kernel where it applies, else `fallback_impl`),
      `pallas` (the Hopper kernel), `ring` (portable ppermute ring) or
      `baseline` (all-gather, then one dot).
    strict: a fallback (pattern found but not served as asked) raises
      `ValueError` instead of being logged.
    fallback_impl: what `auto`, or an unavailable `pallas`, falls back to.
    bidirectional: the ring sends both ways round when the axis has more than
      two devices, halving its sequential steps.
    save_gathered: memory policy for the weight gradients. True: keep the
      operand a collective matmul gathers (the all-gather pattern's
      activation, from forward to backward: D x its memory) so dw needs no
      second all-gather (the default: the same memory XLA's autodiff of
      all-gather + dot keeps); False: gather again in the backward (time).
    reduce_scatter_kernel: let `auto` (and the backward of a `pallas`
      all-gather matmul) use the Hopper matmul-reduce-scatter kernel; off:
      XLA's matmul + reduce-scatter there instead.
    group_siblings: projections of one activation given together
      (`grouped_logical_dot_general`: q/k/v, wi_0/wi_1) run as one
      collective matmul over their concatenated weight columns, sending the
      activation once; off: one collective matmul each.
    exclude: call sites left to XLA whatever they match: their names as
      the decision record gives them (e.g. `decoder/logits_dense`), or
      shell-style patterns (`*logits*`). A call without a name is never
      excluded.
  """

  enabled: bool = False
  impl: Impl = Impl.AUTO
  strict: bool = False
  fallback_impl: Impl = Impl.RING
  bidirectional: bool = True
  save_gathered: bool = True
  reduce_scatter_kernel: bool = True
  group_siblings: bool = True
  exclude: tuple[str, ...] = ()

  def __post_init__(self):
    if isinstance(self.exclude, str):
      raise TypeError(f"exclude={self.exclude!r} must be a sequence of "
                      "names or patterns, not one string")
    object.__setattr__(self, "exclude", tuple(self.exclude))
    for entry in self.exclude:
      if not isinstance(entry, str) or not entry:
        raise TypeError(f"exclude entry {entry!r} must be a non-empty name "
                        "or pattern")
    # Strings (flag values, code) become members here, validated once.
    object.__setattr__(self, "impl", Impl.parse(self.impl, "impl"))
    object.__setattr__(self, "fallback_impl", Impl.parse(
        self.fallback_impl, "fallback_impl", FALLBACK_IMPLEMENTATIONS))


def excluded_by(cfg: CollectiveMatmulConfig, name: str | None) -> str | None:
  """The `exclude` entry that matches the call named `name`, or None."""
  if not name:
    return None
  return next((p for p in cfg.exclude if fnmatch.fnmatchcase(name, p)), None)


_state = threading.local()
_OFF = CollectiveMatmulConfig()
_default: CollectiveMatmulConfig | None = None  # None: not set in code.
# Set by `flags`: the parsed absl flags' configuration, or None while absl
# has not parsed them. Kept as a hook so this module does not import absl.
_from_parsed_flags: Callable[[], CollectiveMatmulConfig | None] = (
    lambda: None)


def get_config() -> CollectiveMatmulConfig:
  """The configuration the drop-in `dot_general` will use when traced now.

  In order: the innermost `config_context`; else what `set_config` set; else
  the plugin's absl flags once absl has parsed them (so `--use_collective_
  matmul` alone switches the plugin on); else the default (off).
  """
  stack = getattr(_state, "stack", None)
  if stack:
    return stack[-1]
  if _default is not None:
    return _default
  return _from_parsed_flags() or _OFF


def set_config(config: CollectiveMatmulConfig | None) -> None:
  """Sets the process-wide configuration; it wins over the absl flags.

  `None` forgets it: the flags (once parsed), else the default, apply again.
  """
  global _default
  if config is not None and not isinstance(config, CollectiveMatmulConfig):
    raise TypeError(f"expected CollectiveMatmulConfig, got {type(config)}")
  _default = config


@contextlib.contextmanager
def config_context(config: CollectiveMatmulConfig | None = None,
                   **overrides) -> Iterator[CollectiveMatmulConfig]:
  """Makes `config` (with `overrides` applied) active inside the block."""
  config = dataclasses.replace(config or get_config(), **overrides)
  stack = getattr(_state, "stack", None)
  if stack is None:
    stack = _state.stack = []
  stack.append(config)
  try:
    yield config
  finally:
    stack.pop()
