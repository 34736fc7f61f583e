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

import jax

from collective_matmul.enums import Impl

IMPLEMENTATIONS = tuple(impl.value for impl in Impl)
FALLBACK_IMPLEMENTATIONS = (Impl.RING.value, Impl.BASELINE.value)


def _option(default, flag: str, help_text: str):
  """A configuration field declared with its absl flag and its description:
  the one place each option is described (`flags` builds the flags and
  `options_table` the README's table from it)."""
  return dataclasses.field(default=default,
                           metadata={"flag": flag, "help": help_text})


@dataclasses.dataclass(frozen=True)
class CollectiveMatmulConfig:
  """What the drop-in `dot_general` does with the collective-matmul pattern.

  Each field's description is its `metadata["help"]` (`options_table()`
  lists them); the absl flag named in `metadata["flag"]` sets it.
  """

  enabled: bool = _option(
      False, "use_collective_matmul",
      "Rewrite the all-gather-then-matmul and matmul-then-reduce-scatter "
      "patterns into collective matmuls. Off: `dot_general` is exactly "
      "`lax.dot_general`.")
  impl: Impl = _option(
      Impl.AUTO, "collective_matmul_impl",
      "`auto`: the Hopper kernel where it applies and pays off; else XLA's "
      "collective + GEMM (NCCL + cuBLAS) on a Hopper GPU where the kernel "
      "may not run (custom calls in XLA's command buffers on a JAX where "
      "that is unchecked, a ring across processes with NCCL older than "
      "2.29.2, the reduce-scatter kernel off) or the problem is too small to "
      "overlap; "
      "else (off Hopper) `fallback_impl`. `pallas`, `ring`, `baseline` force "
      "one: the Hopper kernel, the portable ppermute ring, or XLA's "
      "collective then one dot.")
  strict: bool = _option(
      False, "collective_matmul_strict",
      "A fallback (a pattern found but not served as asked) raises "
      "`cm.StrictFallbackError` (a `ValueError`) instead of being logged.")
  fallback_impl: Impl = _option(
      Impl.RING, "collective_matmul_fallback_impl",
      "What `auto`, or an unavailable `pallas`, runs off Hopper: `ring` or "
      "`baseline`.")
  bidirectional: bool = _option(
      True, "collective_matmul_bidirectional",
      "The portable ring sends both ways round when the axis has more than "
      "two devices, halving its sequential steps.")
  save_gathered: bool = _option(
      True, "collective_matmul_save_gathered",
      "Keep the operand a collective matmul gathers (D x its memory, as "
      "XLA's own autodiff of all-gather + dot keeps) for the weight "
      "gradient; off: gather it again in the backward.")
  reduce_scatter_kernel: bool = _option(
      True, "collective_matmul_reduce_scatter_kernel",
      "Let `auto` (and the backward of an all-gather kernel) use the Hopper "
      "matmul-reduce-scatter kernel; off: XLA's matmul + reduce-scatter "
      "there.")
  group_siblings: bool = _option(
      True, "collective_matmul_group_siblings",
      "Projections of one activation given together (unfused q/k/v, "
      "wi_0/wi_1) run as one collective matmul over their concatenated "
      "weight columns, sending the activation once; off: one each.")
  exclude: tuple[str, ...] = _option(
      (), "collective_matmul_exclude",
      "Call sites left to XLA whatever they match: names as the decision "
      "record gives them (`decoder/logits_dense`) or shell-style patterns "
      "(`*logits*`), comma-separated on the command line.")

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.type == "bool" and not isinstance(value, bool):
        raise TypeError(f"{field.name}={value!r} must be True or False")
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


def flag_name(field_name: str) -> str:
  """The absl flag that sets the `CollectiveMatmulConfig` field
  `field_name` (its declaration's `metadata["flag"]`)."""
  return _FIELDS[field_name].metadata["flag"]


def option_choices(field: dataclasses.Field) -> tuple[str, ...] | None:
  """The values an enum option takes, or None."""
  if field.name == "impl":
    return IMPLEMENTATIONS
  if field.name == "fallback_impl":
    return FALLBACK_IMPLEMENTATIONS
  return None


def options_table() -> str:
  """The options as a Markdown table (README's, checked by a test)."""
  rows = ["| flag | `CollectiveMatmulConfig` field | default | what it does |",
          "|---|---|---|---|"]
  for field in dataclasses.fields(CollectiveMatmulConfig):
    default = field.default
    shown = (str(default).lower() if isinstance(default, bool) else
             ",".join(default) if isinstance(default, tuple) else
             str(default))
    choices = option_choices(field)
    if choices:
      shown += f" ({' / '.join(choices)})"
    rows.append(f"| `--{field.metadata['flag']}` | `{field.name}` | "
                f"{shown or '(none)'} | {field.metadata['help']} |")
  return "\n".join(rows)


_FIELDS = {field.name: field
           for field in dataclasses.fields(CollectiveMatmulConfig)}


def excluded_by(cfg: CollectiveMatmulConfig, name: str | None) -> str | None:
  """The `exclude` entry that matches the call named `name`, or None."""
  if not name:
    return None
  return next((p for p in cfg.exclude if fnmatch.fnmatchcase(name, p)), None)


_state = threading.local()
_OFF = CollectiveMatmulConfig()
# The active configuration as a JAX user context: JAX puts its value in the
# keys of its jit and trace caches (including those of scan, cond, while and
# checkpoint bodies, which are cached by the Python function), so a body
# traced under one configuration is never reused under another.
_TRACE_KEY = jax.make_user_context(None)
_default: CollectiveMatmulConfig | None = None  # None: not set in code.
# The parsed absl flags' configuration, or None while absl has not parsed
# them (`set_flag_reader`; this module does not import absl).
_from_parsed_flags: Callable[[], CollectiveMatmulConfig | None] = (
    lambda: None)


def set_flag_reader(
    reader: Callable[[], CollectiveMatmulConfig | None]) -> None:
  """Makes `get_config` fall back to `reader()`: the configuration the
  parsed command-line flags ask for, or None while they are not parsed.
  `collective_matmul.flags` registers the absl flags' reader on import."""
  global _from_parsed_flags
  _from_parsed_flags = reader


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
  config = _from_parsed_flags() or _OFF
  if _TRACE_KEY.get_global() != config:
    # The flags were parsed since the key was last set: traces from now on
    # are keyed by what they say.
    _TRACE_KEY.set_global(config)
  return config


def set_config(config: CollectiveMatmulConfig | None) -> None:
  """Sets the process-wide configuration; it wins over the absl flags.

  `None` forgets it: the flags (once parsed), else the default, apply again.
  """
  global _default
  if config is not None and not isinstance(config, CollectiveMatmulConfig):
    raise TypeError(f"expected CollectiveMatmulConfig, got {type(config)}")
  _default = config
  _TRACE_KEY.set_global(config)


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
    with _TRACE_KEY(config):
      yield config
  finally:
    stack.pop()
