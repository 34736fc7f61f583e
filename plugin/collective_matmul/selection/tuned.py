"""Measured configs: the per-host autotune cache and the packaged table.

A lookup returns `(config, source)` or None. The packaged table
(`tuned_configs.json`, shipped with the package) is read in every program;
the per-host cache only in a single-process program, since processes that
read different files could choose differently and hang the ring. Both are
read like input: an entry that does not build its kernel's config with
fields of the right types and ranges is a miss, logged once with the
reason, never an error; a cache file that cannot be read is set aside when
the next autotune result is stored.
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import importlib.resources
import json
import os
import tempfile
import time
import types
from typing import Mapping

from absl import logging
import jax

from collective_matmul.enums import Collective
from collective_matmul.kernels.configs import AllGatherConfig
from collective_matmul.kernels.configs import DEFAULT_SM_COUNT
from collective_matmul.kernels.configs import FP8_TILE_K
from collective_matmul.kernels.configs import REMOVED_FIELDS
from collective_matmul.kernels.configs import ReduceScatterConfig
from collective_matmul.kernels.configs import SMEM_BYTES
from collective_matmul.kernels.configs import TileConfig
from collective_matmul.kernels.configs import axis_reason
from collective_matmul.selection.problem import Problem

AUTOTUNE_CACHE = "autotune cache"
PACKAGED_TABLE = "packaged table"

# A cache entry's collective: the kernel it configures.
CACHE_COLLECTIVES = tuple(c.value for c in Collective)
CONFIG_CLASSES = {Collective.ALL_GATHER: AllGatherConfig,
                  Collective.REDUCE_SCATTER: ReduceScatterConfig}
# The largest value of each integer field a stored config may hold, past
# which no config is a real one: a tile side of which two pipeline stages of
# the smallest k step (32) do not fit shared memory even with 1-byte
# operands; more pipeline stages than ever fit; a
# sender block on every SM of an H100/H200; a pacing or grid width of more
# steps or tiles than any shard has. A larger value in a file is damage, and a miss.
_MAX_TILE_SIDE = SMEM_BYTES // (2 * 32)
_MAX_STEPS = 1 << 16
FIELD_LIMITS = {
    "tile_m": _MAX_TILE_SIDE, "tile_n": _MAX_TILE_SIDE,
    "epi_tile_m": _MAX_TILE_SIDE, "epi_tile_n": _MAX_TILE_SIDE,
    "tile_k": 128, "max_concurrent_steps": 64,
    "epi_slots": 2,
    "grid_tile_width": _MAX_STEPS, "send_gap": _MAX_STEPS,
    "sender_sms": DEFAULT_SM_COUNT - 1,
    "send_pieces": _MAX_TILE_SIDE // 8,
}


def cache_path() -> str:
  return os.environ.get(
      "COLLECTIVE_MATMUL_TUNING_CACHE",
      os.path.join(os.path.expanduser("~"), ".cache", "collective_matmul",
                   "tuning.json"))


def cache_key(problem: Problem, device_kind: str,
              collective=Collective.ALL_GATHER) -> str:
  """Key of a cache or table entry for `problem` (its result dtype aside):
  the operands' dtype, or both where they differ (`float8_e5m2,
  float8_e4m3fn`), so a bf16 entry never serves fp8 operands; the two
  kernels' entries never mix."""
  collective = Collective.parse(collective, "collective")
  lhs, rhs = problem.operand_dtypes
  dtypes = lhs.name if lhs == rhs else f"{lhs.name},{rhs.name}"
  key = (f"{device_kind}|{dtypes}|"
         f"D={problem.axis_size}|{problem.rows}x{problem.k}x{problem.n}")
  return (key if collective == Collective.ALL_GATHER
          else f"{collective.value}|{key}")


def key_collective(key: str) -> Collective:
  """The collective of a `cache_key`."""
  head = key.split("|", 1)[0]
  return (Collective.parse(head, "collective") if head in CACHE_COLLECTIVES
          else Collective.ALL_GATHER)


_FIELD_TYPES = {"int": (int,), "bool": (bool,), "str": (str,),
                "str | None": (str, type(None)),
                "MatmulDimension": (str,)}


def config_from_fields(collective: Collective, fields) -> TileConfig:
  """`collective`'s config class built from an entry's fields (a JSON object),
  each of its declared type (a bool is no int, 128.0 no int, "no" no bool)
  and, if an integer, at most its `FIELD_LIMITS`. A field removed since
  (`configs.REMOVED_FIELDS`) is dropped where it holds the value the
  kernels now always take (an entry stored before reads as it ran), with a
  logged note.

  Raises:
    TypeError, ValueError: naming the field, when they do not build one
      (a removed field at another value: the kernels no longer run that).
  """
  if not isinstance(fields, dict):
    raise TypeError(f"config {fields!r} is not a JSON object")
  cls = CONFIG_CLASSES[collective]
  declared = {f.name: f.type for f in dataclasses.fields(cls)}
  fields = _without_removed_fields(fields, declared)
  for name, value in fields.items():
    if name not in declared:
      raise TypeError(f"{cls.__name__} has no field {name!r}")
    allowed = _FIELD_TYPES[str(declared[name])]
    if not isinstance(value, allowed) or (
        isinstance(value, bool) and bool not in allowed):
      raise TypeError(f"{name}={value!r} must be of type {declared[name]}")
    limit = FIELD_LIMITS.get(name)
    if isinstance(value, int) and limit is not None and value > limit:
      raise ValueError(f"{name}={value} is more than {limit}")
  return cls(**fields)


def _without_removed_fields(fields: dict, declared) -> dict:
  """`fields` without the removed fields (`configs.REMOVED_FIELDS`) that
  hold the value the kernels now always take; raises ValueError for one at
  another value."""
  removed = {name: value for name, value in fields.items()
             if name in REMOVED_FIELDS and name not in declared}
  for name, value in removed.items():
    if value != REMOVED_FIELDS[name]:
      raise ValueError(
          f"{name}={value!r}: the field was removed, and the kernels run "
          f"only what {name}={REMOVED_FIELDS[name]!r} ran")
  if removed:
    _log_note(f"removed fields {sorted(removed)}",
              "dropped at the values the kernels always take now")
  return {name: value for name, value in fields.items()
          if name not in removed}


_logged_misses: set[tuple[str, str]] = set()
_logged_notes: set[str] = set()


def _log_note(what: str, note: str) -> None:
  """One info line per distinct note on entries that are still used."""
  if what in _logged_notes:
    return
  _logged_notes.add(what)
  logging.info("collective matmul: %s in stored configs: %s", what, note)


def _log_miss(origin: str, what: str, reason) -> None:
  """One warning per distinct unreadable entry or file."""
  if (origin, what) in _logged_misses:
    return
  _logged_misses.add((origin, what))
  logging.warning("collective matmul: %s in %s not used: %s", what, origin,
                  reason)


def _read_json(path: str):
  """The parsed file; raises ValueError (with the cause) when it is not
  JSON this reader takes."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, UnicodeDecodeError, RecursionError,
          json.JSONDecodeError) as e:
    raise ValueError(f"{type(e).__name__}: {e}") from e


def load_cached_config(problem: Problem, device_kind: str, *,
                       collective=Collective.ALL_GATHER):
  """The autotuned config of this problem for `collective`'s kernel, or None
  (no file, no entry, an entry this version cannot read, or a program of
  several processes, where each would read its own host's file)."""
  path = cache_path()
  if not os.path.exists(path):
    return None
  if jax.process_count() > 1:
    _log_miss(path, "the autotune cache",
              "a multi-process program does not read a per-host file "
              "(each process could choose differently)")
    return None
  collective = Collective.parse(collective, "collective")
  key = cache_key(problem, device_kind, collective)
  try:
    table = _read_json(path)
  except ValueError as e:
    _log_miss(path, "the file", e)
    return None
  if not isinstance(table, dict):
    _log_miss(path, "the file", "it is not a JSON object")
    return None
  if key not in table:
    return None
  try:
    config = config_from_fields(collective, table[key])
    reason = axis_reason(config, problem.axis_size)
    if reason:
      raise ValueError(reason)
    return config
  except (TypeError, ValueError) as e:
    _log_miss(path, f"entry {key!r}", e)
    return None


def _table_to_update(path: str) -> dict:
  """The cache's table, to add an entry to: {} when there is no file, or
  when it cannot be read (then set aside as `<path>.damaged-<time>`,
  logged)."""
  if not os.path.exists(path):
    return {}
  try:
    table = _read_json(path)
    if not isinstance(table, dict):
      raise ValueError("it is not a JSON object")
    return table
  except ValueError as e:
    aside = f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    os.replace(path, aside)
    logging.warning("collective matmul: the autotune cache %s was not "
                    "readable (%s); moved to %s, writing a new one", path, e,
                    aside)
    return {}


def store_cached_config(config: AllGatherConfig | ReduceScatterConfig,
                        problem: Problem, device_kind: str, *,
                        collective=None) -> str:
  """Stores `config` as the tuned one of its kernel (`collective`: None, or
  the collective of the config's class) for `problem`; returns the path.

  A cache file that cannot be read is set aside (`<path>.damaged-<time>`,
  logged) and a new one written, so a sweep's result is never lost to it.
  Processes storing at the same time take turns (a lock on `<path>.lock`),
  so none loses another's entry.
  """
  own = next(p for p, cls in CONFIG_CLASSES.items()
             if type(config) is cls)  # pylint: disable=unidiomatic-typecheck
  if (collective is not None
      and Collective.parse(collective, "collective") != own):
    raise ValueError(f"a {type(config).__name__} is the {own.value!r} "
                     f"kernel's config, not the {collective!r} kernel's")
  path = cache_path()
  folder = os.path.dirname(path) or "."
  os.makedirs(folder, exist_ok=True)
  # Read, merge and replace under an exclusive lock on a sidecar file, so a
  # writer never replaces the table with one read before another writer's
  # store; each writer's temporary file is its own, in the same folder (an
  # atomic rename needs one file system).
  with open(path + ".lock", "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    table = _table_to_update(path)
    table[cache_key(problem, device_kind, own)] = config.to_json()
    fd, temp = tempfile.mkstemp(dir=folder,
                                prefix=os.path.basename(path) + ".",
                                suffix=".tmp")
    try:
      os.fchmod(fd, 0o644)  # mkstemp's 0o600 would hide it from others.
      with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
      os.replace(temp, path)
    except BaseException:
      os.unlink(temp)
      raise
  return path


# Package data next to this package; its "_about" says how entries are made.
TUNED_CONFIGS_FILE = "tuned_configs.json"


def parse_tuned_configs(data, origin: str = TUNED_CONFIGS_FILE
                        ) -> Mapping[str, TileConfig]:
  """{cache key: config} of a table in `tuned_configs.json`'s format.

  An entry whose key or config is missing, whose fields do not build its
  kernel's config class (fields of another version), or whose key repeats
  an earlier entry is skipped with a logged warning, never an error.
  """
  table = {}
  entries = data.get("entries", []) if isinstance(data, dict) else None
  if not isinstance(entries, list):
    logging.warning("collective matmul: %s has no list of entries; not used",
                    origin)
    return types.MappingProxyType(table)
  for i, entry in enumerate(entries):
    try:
      key = entry["key"]
      if key in table:
        raise ValueError(f"key {key!r} repeats an earlier entry")
      table[key] = config_from_fields(key_collective(key), entry["config"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      logging.warning("collective matmul: entry %d of %s skipped: %s", i,
                      origin, e)
  return types.MappingProxyType(table)


@functools.cache
def packaged_table() -> Mapping[str, TileConfig]:
  """The packaged table of measured configs (`tuned_configs.json`), read
  once; empty, with a logged warning, when it cannot be read."""
  try:
    text = importlib.resources.files("collective_matmul").joinpath(
        TUNED_CONFIGS_FILE).read_text()
    data = json.loads(text)
  except (OSError, ValueError) as e:
    logging.warning("collective matmul: the packaged table %s is not "
                    "readable (%s); not used", TUNED_CONFIGS_FILE, e)
    return types.MappingProxyType({})
  return parse_tuned_configs(data)


def packaged_config(problem: Problem, device_kind: str, *,
                    collective=Collective.ALL_GATHER):
  """The packaged table's measured config of `problem` for `collective`'s
  kernel, or None."""
  return packaged_table().get(cache_key(problem, device_kind, collective))


def measured_config(collective: Collective, problem: Problem,
                    device_kind: str) -> tuple[TileConfig, str] | None:
  """The first measured config of `problem` for `collective`'s kernel,
  with as many of its pipeline stages as fit shared memory for the
  problem's dtypes (`TileConfig.fit_shared_memory`), and its source: the
  autotune cache's, then the packaged table's; else None. An entry the
  problem's operands cannot run with (fp8 needs `FP8_TILE_K`) is a miss,
  logged once."""
  for source, lookup in ((AUTOTUNE_CACHE, load_cached_config),
                         (PACKAGED_TABLE, packaged_config)):
    found = lookup(problem, device_kind, collective=collective)
    if found is None:
      continue
    if problem.is_fp8 and found.tile_k != FP8_TILE_K:
      _log_miss(source,
                f"entry {cache_key(problem, device_kind, collective)!r}",
                f"tile_k={found.tile_k}: fp8 operands need tile_k="
                f"{FP8_TILE_K}")
      continue
    fitted = found.fit_shared_memory(*problem.itemsizes)
    if fitted is not None:
      return fitted, source
    _log_miss(source, f"entry {cache_key(problem, device_kind, collective)!r}",
              "it needs more shared memory than a block has with "
              f"{problem.dtype_label()}")
  return None

