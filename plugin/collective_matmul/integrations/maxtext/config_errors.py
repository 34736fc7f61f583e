"""MaxText's config errors in one line naming the key (for the launcher).

MaxText reads its config before the first step: the YAML files, the
key=value overrides and pydantic's validation (`pyconfig.initialize`), then
the mesh those keys describe. MaxText raises an error there with its
traceback (and, for an unknown key, lists every valid key). Within
`in_one_line(argv)` such an error is raised as `MaxTextConfigError`: its
last meaningful line, with the key it concerns, the original as its cause.

`describe`, `checked` and `plugin_flags_written_as_keys` need no MaxText
(tested without it).
"""
from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
from typing import Any, Callable, Iterator, Sequence

# pyconfig's message for a key that is not a MaxText field: the key, then
# every valid key.
_UNKNOWN_KEY = re.compile(r"^'([^']+)' not in ('.*')\.?$", re.S)
_MESH_KEY = re.compile(r"^(ici|dcn)_\w*parallelism$")


class MaxTextConfigError(ValueError):
  """MaxText refused its config. `key`: the key it concerns (None where the
  error names none); str: one line, which names it."""

  def __init__(self, line: str, key: str | None = None):
    super().__init__(line)
    self.key = key


def _given(argv: Sequence[str]) -> dict[str, str]:
  """The key=value arguments of MaxText's command line."""
  return dict(arg.split("=", 1) for arg in argv[2:] if "=" in arg
              and not arg.startswith("-"))


def plugin_flags_written_as_keys(argv: Sequence[str],
                                 flag_names: dict[str, bool]) -> str | None:
  """One line pointing each launcher flag written as a MaxText key
  (`use_collective_matmul=True`) to its flag, or None. `flag_names`: the
  launcher's flags, name -> whether it is boolean."""
  hints = []
  for key, value in _given(argv).items():
    if key not in flag_names:
      continue
    if not flag_names[key]:
      flag = f"--{key}={value}"
    elif value.strip().lower() in ("false", "0", "no", "off"):
      flag = f"--no{key} (or leave it out)"
    else:
      flag = f"--{key}"
    hints.append(f"{key}={value}: not a MaxText config key but the plugin's "
                 f"flag: write {flag}")
  return "; ".join(hints) or None


def last_line(error: BaseException) -> str:
  """The last line of `error`'s text that says something (not pydantic's
  'For further information' link), whitespace collapsed."""
  lines = [" ".join(line.split()) for line in str(error).splitlines()]
  lines = [line for line in lines
           if line and not line.startswith("For further information")]
  return lines[-1] if lines else type(error).__name__


def describe(error: BaseException,
             argv: Sequence[str] = ()) -> MaxTextConfigError:
  """`error`, raised while MaxText read the config of `argv` (the
  launcher's command line: program, config file, key=value ...), as one
  line naming the key."""
  given = _given(argv)
  errors = getattr(error, "errors", None)
  if type(error).__name__ == "ValidationError" and callable(errors):
    # pydantic: one entry per field and type tried (int, then float, ...).
    by_key: dict[str, list[str]] = {}
    for entry in errors():
      key = str(entry["loc"][0]) if entry.get("loc") else ""
      by_key.setdefault(key, [])
      if entry["msg"] not in by_key[key]:
        by_key[key].append(entry["msg"])
    parts = [(f"{key}={given[key]!r}: " if key in given else
              f"{key}: " if key else "") + " or ".join(messages)
             for key, messages in by_key.items()]
    return MaxTextConfigError("; ".join(parts),
                              next(iter(by_key), None) or None)
  match = _UNKNOWN_KEY.match(str(error).strip())
  if isinstance(error, ValueError) and match:
    key = match.group(1)
    valid = re.findall(r"'([^']+)'", match.group(2))
    close = difflib.get_close_matches(key, valid, n=3)
    return MaxTextConfigError(
        f"{key}: not a MaxText config key" + (
            f" (did you mean {', '.join(close)}?)" if close else ""), key)
  if isinstance(error, OSError) and error.filename:
    config_file = argv[1] if len(argv) > 1 else None
    is_config_file = config_file is not None and os.path.abspath(
        str(error.filename)) == os.path.abspath(config_file)
    key = "config file" if is_config_file else "base_config"
    return MaxTextConfigError(
        f"{key}: cannot read {error.filename}: "
        f"{error.strerror or last_line(error)}", key)
  line = last_line(error)
  key = next((key for key in given if re.search(rf"\b{re.escape(key)}\b",
                                                line)), None)
  return MaxTextConfigError(f"{key}: {line}" if key else line, key)


def describe_mesh(error: BaseException, argv: Sequence[str],
                  num_devices: int) -> MaxTextConfigError:
  """An error building the mesh the config describes, naming the
  parallelism keys given."""
  given = [f"{key}={value}" for key, value in _given(argv).items()
           if _MESH_KEY.match(key)]
  key = ", ".join(given) or "the mesh"
  return MaxTextConfigError(
      f"{key}: {last_line(error)} ({num_devices} devices)", key)


class _DropPyconfigErrors(logging.Filter):
  """pyconfig logs an error's whole text before raising it; the launcher
  says it in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR
                and record.module == "pyconfig")


def checked(initialize: Callable[..., Any], argv: Sequence[str],
            build_mesh: Callable[[Any], Any] = lambda config: None,
            device_count: Callable[[], int] = lambda: 0
            ) -> Callable[..., Any]:
  """`initialize` (MaxText's `pyconfig.initialize`), raising
  `MaxTextConfigError` from the original error where it refuses the config
  of `argv`, then `build_mesh(config)` (raising it for a mesh the
  `device_count()` devices cannot make)."""
  drop = _DropPyconfigErrors()

  def checked_initialize(*args, **kwargs):
    loggers = [logging.getLogger(), logging.getLogger("absl")]
    for logger in loggers:
      logger.addFilter(drop)
    try:
      config = initialize(*args, **kwargs)
    except SystemExit as e:
      # Outside tests pyconfig exits (status 2) while handling the error.
      if isinstance(e.__context__, Exception):
        raise describe(e.__context__, argv) from e.__context__
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise describe(e, argv) from e
    finally:
      for logger in loggers:
        logger.removeFilter(drop)
    try:
      build_mesh(config)
    except (AssertionError, ValueError) as e:
      raise describe_mesh(e, argv, device_count()) from e
    return config

  return checked_initialize


@contextlib.contextmanager
def in_one_line(argv: Sequence[str]) -> Iterator[None]:
  """Within: MaxText's `pyconfig.initialize` is `checked`, with the mesh
  MaxText's trainer builds from the config (and the devices)."""
  import jax  # pylint: disable=g-import-not-at-top
  from maxtext.configs import pyconfig  # pylint: disable=g-import-not-at-top
  from maxtext.utils import maxtext_utils  # pylint: disable=g-import-not-at-top
  initialize = pyconfig.initialize
  pyconfig.initialize = checked(initialize, argv,
                                maxtext_utils.get_mesh_from_config,
                                jax.device_count)
  try:
    yield
  finally:
    pyconfig.initialize = initialize
