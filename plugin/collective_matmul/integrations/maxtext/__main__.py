"""MaxText's trainer with the collective matmul plugin installed.

    python -m collective_matmul.integrations.maxtext \\
        <maxtext>/configs/base.yml key=value ... \\
        [--use_collective_matmul] \\
        [--collective_matmul_impl=auto|pallas|ring|baseline] \\
        [--collective_matmul_strict] [--maxtext_shard_gpu_attention] \\
        [--maxtext_allow_untested_version]

MaxText's own command line is passed through unchanged; the plugin's absl
flags (below) may appear anywhere in it, written as flags
(`--use_collective_matmul`), not as MaxText keys. `--help` lists them
without loading MaxText; `--helpfull` adds the flags MaxText's modules
define. After each compile that traced projections,
the decision record (what was rewritten, with which implementation, or why
not) is printed once, and so is what `--maxtext_shard_gpu_attention` did
with each flash attention call (`attention`). The run ends with a summary:
the projections rewritten or left (with reasons) and the plugin's settings.
MaxText logs its whole config first; `log_config=False` skips that.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from typing import Sequence

from absl import app
from absl import flags
import jax

import collective_matmul as cm
from collective_matmul import config as config_lib
from collective_matmul.enums import Impl
from collective_matmul.integrations.maxtext import adapter
from collective_matmul.integrations.maxtext import attention
from collective_matmul.integrations.maxtext import config_errors
from collective_matmul.integrations.maxtext import summary

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_PROGRAM = "python -m collective_matmul.integrations.maxtext"
_HELP_FLAGS = ("--help", "-help", "-h", "--helpfull", "-helpfull",
               "--helpshort", "-helpshort", "-?")
_FULL_HELP_FLAGS = ("--helpfull", "-helpfull")


def maxtext_missing(version: tuple[int, int] = sys.version_info[:2]) -> str:
  """What a run without MaxText says (one line): on Python < 3.12 the
  maxtext extra installs nothing (MaxText needs 3.12), so say that."""
  here = f"Python {version[0]}.{version[1]}"
  if tuple(version) < (3, 12):
    return (f"{_PROGRAM}: MaxText needs Python >= 3.12 and this is {here}, "
            'where pip install -e ".[maxtext]" installs no MaxText; in a '
            'Python 3.12 environment: pip install -e ".[maxtext]" (from this '
            "repository)")
  return (f"{_PROGRAM}: MaxText is not installed in this {here} (it needs "
          'Python >= 3.12 and the maxtext extra): pip install -e ".[maxtext]" '
          "(from this repository)")


MAXTEXT_MISSING = maxtext_missing()


def maxtext_available() -> bool:
  """Whether the `maxtext` package can be imported (without importing it)."""
  try:
    return importlib.util.find_spec("maxtext") is not None
  except (ImportError, ValueError):
    return False


_PLUGIN_FLAG_MODULES = (cm.flags, attention, summary)
# What --help says after the plugin's flags.
MAXTEXT_OPTIONS_NOTE = (
    "MaxText's own options are key=value overrides of the config file given "
    "first (its configs/base.yml lists them); --helpfull adds the absl flags "
    "that MaxText's modules define (it imports MaxText first, 10-20 s).")


def plugin_flag_names() -> dict[str, bool]:
  """The launcher's own flags (the plugin's and the MaxText glue's): name ->
  whether it is a boolean flag."""
  return {flag.name: flag.boolean
          for module in _PLUGIN_FLAG_MODULES
          for flag in flags.FLAGS.get_flags_for_module(module)}


def usage() -> str:
  """The launcher's usage and the plugin's flags, which need no MaxText."""
  plugin_flags = "\n\n".join(
      flags.FLAGS.module_help(module).strip()
      for module in _PLUGIN_FLAG_MODULES)
  return f"{__doc__.strip()}\n\nflags:\n\n{plugin_flags}\n"


def print_decisions_after_compiles() -> None:
  """Prints the decisions recorded since the last compile, once per distinct
  record, when a compile ends (JAX's compile-duration event)."""
  printed = {"count": 0, "tables": set(), "notes": set()}

  def on_event(event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs, kwargs
    if event != _BACKEND_COMPILE_EVENT:
      return
    for note in attention.notes():
      if note not in printed["notes"]:
        printed["notes"].add(note)
        print(f"collective matmul (MaxText): {note}", flush=True)
    records = cm.decisions()
    new = records[printed["count"]:]
    printed["count"] = len(records)
    if not new or not cm.get_config().enabled:
      return
    table = cm.format_decisions(new)
    if table not in printed["tables"]:
      printed["tables"].add(table)
      print(table, flush=True)
      hint = summary.nothing_rewritten_hint(new)
      if hint:
        print(f"collective matmul: {hint}", flush=True)

  jax.monitoring.register_event_duration_secs_listener(on_event)


def main(argv: Sequence[str]) -> None:
  try:
    version = adapter.install(
        True if summary.ALLOW_UNTESTED_VERSION.value else None)
  except adapter.MaxTextVersionError as e:
    print(f"{_PROGRAM}: {e}", file=sys.stderr)
    sys.exit(2)
  config = cm.get_config()  # The parsed flags' configuration.
  print(f"collective matmul: MaxText {version} patched; plugin "
        f"{'on, impl=' + config.impl if config.enabled else 'off'}; "
        f"sharded GPU flash attention "
        f"{'on' if attention.enabled() else 'off'}"
        f"; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
  if not any(arg.partition("=")[0] == "log_config" for arg in argv[1:]):
    print(summary.CONFIG_DUMP_POINTER, flush=True)
  print_decisions_after_compiles()
  from maxtext.trainers.pre_train import train  # pylint: disable=g-import-not-at-top
  # MaxText's config errors in one line; --verbosity keeps its traceback.
  verbose = flags.FLAGS["verbosity"].present
  try:
    with (contextlib.nullcontext() if verbose else
          config_errors.in_one_line(argv)):
      train.main(list(argv))
  except config_errors.MaxTextConfigError as e:
    print(f"{_PROGRAM}: MaxText config error: {e} (--verbosity=0 shows "
          "MaxText's traceback)", file=sys.stderr)
    sys.exit(2)
  except cm.StrictFallbackError as e:
    print(f"{_PROGRAM}: {str(e).splitlines()[0]} "
          f"(--{config_lib.flag_name('strict')} refuses a fallback; without "
          "it the projection falls back as recorded)", file=sys.stderr)
    sys.exit(1)
  print(summary.summary(cm.decisions(), config, version,
                        attention.enabled()), flush=True)


def _kernels_may_run(argv: Sequence[str]) -> bool:
  """Whether the command line switches the plugin on with an implementation
  that may pick the Hopper kernels (read before absl parses it: XLA_FLAGS
  must be set before JAX starts its backend)."""
  enabled, impl = map(config_lib.flag_name, ("enabled", "impl"))
  on, chosen = False, config_lib.CollectiveMatmulConfig().impl
  for arg in argv[1:]:
    name, _, value = arg.partition("=")
    name = name.lstrip("-")
    if name == enabled:
      on = value.lower() not in ("false", "0", "no")
    elif name == f"no{enabled}":
      on = False
    elif name == impl:
      chosen = value
  return on and chosen in (Impl.AUTO, Impl.PALLAS)


def _asks_for_help(argv: Sequence[str]) -> bool:
  return any(arg.partition("=")[0] in _HELP_FLAGS for arg in argv[1:])


def run() -> None:
  if _asks_for_help(sys.argv):
    # The plugin's flags first, before MaxText's slow and noisy import.
    print(usage(), flush=True)
    if not maxtext_available():
      print(f"note: {MAXTEXT_MISSING}")
      sys.exit(0)
    if not any(arg.partition("=")[0] in _FULL_HELP_FLAGS
               for arg in sys.argv[1:]):
      print(MAXTEXT_OPTIONS_NOTE)
      sys.exit(0)
  if not maxtext_available():
    print(MAXTEXT_MISSING, file=sys.stderr)
    sys.exit(2)
  misplaced = config_errors.plugin_flags_written_as_keys(
      sys.argv, plugin_flag_names())
  if misplaced:
    print(f"{_PROGRAM}: {misplaced}", file=sys.stderr)
    sys.exit(2)
  if _kernels_may_run(sys.argv):
    # XLA_FLAGS stay as the user set them (command buffers on) where this
    # JAX's kernels are checked under CUDA-graph capture; else custom calls
    # leave the command buffers, only for runs that may use the kernels, so
    # a plugin-off run is stock MaxText's program.
    cm.prepare_xla_for_kernels()
  # MaxText's modules define absl flags of their own: import them before
  # absl parses the command line.
  from maxtext.trainers.pre_train import train  # pylint: disable=g-import-not-at-top,unused-import
  try:
    app.run(main, argv=sys.argv)
  except SystemExit as e:
    # absl ends --help with status 1; asking for help is not an error.
    if e.code == 1 and _asks_for_help(sys.argv):
      sys.exit(0)
    raise


if __name__ == "__main__":
  run()
