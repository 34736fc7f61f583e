"""orbax checkpoints of the train state: periodic save, verified resume, keep N.

The train state holds plain arrays, so a checkpoint does not record whether it
was written with the collective matmul on or off; restoring into the same
abstract state (shapes, dtypes, shardings) works either way.

Every step is *sealed* once orbax has finalized it: `integrity.json` in the
step directory records the size and sha256 of each of its files, the state's
layout (path -> dtype[shape]) and the resolved config of the run. An
asynchronous save is sealed at the first `poll` (the trainer's next step
boundary) after orbax finishes it. A restore verifies steps from the newest
down against their records, and against the files on disk: a file missing,
changed, or on disk but not in the record is reported. A step orbax finished
but that was never sealed (the run was killed between the two) is checked by
its content (orbax's commit marker and timestamp, this trainer's marker, the
required files, and a full restore) and then sealed; one that fails is set
aside. A bad step is reported in one line and moved aside to
`<step>.damaged` (orbax no longer sees it, and its step can be saved again),
and the newest intact step is restored. When no step was ever sealed and none
can be, the run starts from scratch, saying so; when every sealed step is
damaged, `NoIntactCheckpointError` (nothing moved). A checkpoint whose state
layout differs from this run's (another model) is refused with
`IncompatibleCheckpointError`, naming the config keys that differ.

Ownership: each save carries this trainer's marker in orbax's own step
metadata (`_CHECKPOINT_METADATA`, written before orbax's first data file), so
the Checkpointer deletes only steps and unfinished saves that it wrote.
Anything else named like a step or an unfinished save (a user's file
`checkpoints/6`, a directory from elsewhere) is reported and renamed to
`<name>.foreign`, never deleted or overwritten. One Checkpointer writes a
directory at a time: `writer.lock` there names its host and pid (a lock
left by a dead process is taken over with a note). The directory is checked
for being writable when the Checkpointer opens it; a full disk, a read-only
file system or a path that is not a directory is `StorageError`, one line
naming the path and the cause.

Rotation is done here rather than by orbax's `max_to_keep`: it keeps the
newest `max_num_checkpoints_to_keep` sealed steps and deletes only own steps
older than those, so the newest verified checkpoint is never deleted.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
from typing import Any, Callable, Mapping

import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp
import yaml

from reference_host import config as config_lib

INTEGRITY_FILE = "integrity.json"
INTEGRITY_FORMAT = 1
# The resolved config of the run that wrote the newest checkpoint, for people.
RUN_CONFIG_FILE = "config.yml"
# orbax writes a step into `<step>.orbax-checkpoint-tmp[-<time>]`, then renames
# it to `<step>`.
UNFINISHED_SAVE_MARKER = ".orbax-checkpoint-tmp"
DAMAGED_SUFFIX = ".damaged"
# Entries named like a step or an unfinished save that this trainer did not
# write are renamed to `<name>.foreign`.
FOREIGN_SUFFIX = ".foreign"
# A step being deleted by rotation is first renamed to `<step>.deleting`.
DELETING_SUFFIX = ".deleting"
# One writer per directory: host, pid and start time of the Checkpointer (or
# train.py run) holding it; emptied when it is released.
LOCK_FILE = "writer.lock"
# orbax's step metadata: written when a save starts (with `custom_metadata`,
# which holds this trainer's marker) and given `commit_timestamp_nsecs` when
# orbax finalizes the step, just before it writes ORBAX_COMMIT_FILE and
# renames the step's temporary directory.
ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"
ORBAX_COMMIT_FILE = "commit_success.txt"
# The key of this trainer's marker in orbax's custom_metadata.
OWNER_KEY = "reference_host"
# Files orbax writes into every finalized StandardSave step.
REQUIRED_FILES = (ORBAX_STEP_METADATA, "default/_METADATA",
                  "default/manifest.ocdbt")
# Keys that describe the run rather than the state: they may change on resume
# and are not reported (mesh_axis_sizes follows the ici_* keys, which are).
RUN_KEYS = frozenset({
    "run_name", "base_output_directory", "checkpoint_dir", "steps",
    "log_period", "enable_checkpointing", "checkpoint_period",
    "max_num_checkpoints_to_keep", "async_checkpointing", "mesh_axis_sizes",
})
_HASH_CHUNK_BYTES = 1 << 22
_STEP_NAME = re.compile(r"^[0-9]+$")
_UNFINISHED_NAME = re.compile(r"^[0-9]+" + re.escape(UNFINISHED_SAVE_MARKER))
_DELETING_NAME = re.compile(r"^[0-9]+" + re.escape(DELETING_SUFFIX) + "$")
# What orbax puts in a step directory, finished or not.
_ORBAX_ENTRIES = frozenset({ORBAX_STEP_METADATA, ORBAX_COMMIT_FILE, "default",
                            "default" + UNFINISHED_SAVE_MARKER})
# Causes of a failed write that are the storage's, not the program's.
STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "not a directory",
    errno.EEXIST: "exists and is not a directory",
    errno.EIO: "input/output error",
}
# TensorStore's errno in its message; inside a repr (asyncio's "exception
# was never retrieved" shows the future's) the quotes are escaped.
_ERRNO_IN_TEXT = re.compile(r"os_error_code=\\?'?([0-9]+)")


class CheckpointError(RuntimeError):
  """A checkpoint directory that cannot be resumed as it is."""


class NoIntactCheckpointError(CheckpointError):
  """Every sealed step in the directory is damaged or incomplete."""


class IncompatibleCheckpointError(CheckpointError):
  """The newest intact checkpoint holds a different model than the config."""


class StorageError(CheckpointError):
  """A directory that cannot be written: full, read-only, not a directory,
  no permission. The message is one line naming the path and the cause."""


class RunLockedError(CheckpointError):
  """Another trainer (alive) writes this run."""


def _print_on_process_0(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


def _is_primary() -> bool:
  return jax.process_index() == 0


def _sync(name: str) -> None:
  """All processes wait here (a no-op with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"reference_host_checkpoint:{name}")


def _from_primary(values: list[int]) -> list[int]:
  """Process 0's `values` on every process."""
  if jax.process_count() == 1:
    return values
  array = multihost_utils.broadcast_one_to_all(np.asarray(values, np.int64))
  return [int(v) for v in np.asarray(array)]


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [""])[0]


# ---- Storage errors -------------------------------------------------------


def storage_cause(error: BaseException) -> str | None:
  """'No space left on device (ENOSPC)' when `error` (or what caused it) is
  a storage failure: an OSError with one of STORAGE_ERRNOS, or an orbax /
  TensorStore error whose text carries such an errno. Else None."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    code = getattr(error, "errno", None) if isinstance(error, OSError) else None
    if code is None:
      match = _ERRNO_IN_TEXT.search(str(error))
      code = int(match.group(1)) if match else None
    if code in STORAGE_ERRNOS:
      return f"{os.strerror(code)} ({errno.errorcode[code]})"
    error = error.__cause__ or error.__context__
  return None


def _storage_error(what: str, path: str, error: BaseException
                   ) -> StorageError | None:
  cause = storage_cause(error)
  if cause is None:
    return None
  return StorageError(f"cannot write {what} {path}: {cause}")


def check_writable_directory(path: str, what: str = "directory") -> str:
  """Creates `path` if needed and writes (and removes) a small file there.

  Raises StorageError, one line naming the path and the cause, where it is
  (or is under) a file, read-only, full, or not permitted. Returns the
  absolute path."""
  path = os.path.abspath(path)
  parent = path
  while parent and not os.path.lexists(parent):
    parent = os.path.dirname(parent)
  if parent and not os.path.isdir(parent):
    raise StorageError(
        f"cannot use {path} as the {what}: {parent} is a file, not a "
        "directory (ENOTDIR)")
  probe = os.path.join(path, f".write-test-{os.getpid()}")
  try:
    os.makedirs(path, exist_ok=True)
    with open(probe, "wb") as f:
      f.write(b"\0" * 4096)
      f.flush()
      os.fsync(f.fileno())
    os.remove(probe)
  except OSError as e:
    if os.path.exists(probe):
      try:
        os.remove(probe)
      except OSError:
        pass
    cause = storage_cause(e) or f"{type(e).__name__}: {e.strerror or e}"
    raise StorageError(f"cannot write to the {what} {path}: {cause}") from e
  return path


# ---- One writer per run ---------------------------------------------------


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


class RunLock:
  """`<directory>/writer.lock`, held with flock by one process at a time.

  Its content names the holder (host, pid, start time), for the refusal
  message; it is emptied on `release`. The kernel drops the flock when the
  holder dies, so a lock left by a killed run is free and is taken over, with
  a note naming the old holder. Where the file system has no flock, a lock of
  this host whose pid is dead is taken over, and any other is refused.
  """

  def __init__(self, directory: str, *, what: str = "run",
               log: Callable[[str], None] | None = None):
    self.directory = os.path.abspath(directory)
    self.path = os.path.join(self.directory, LOCK_FILE)
    self.what = what
    self._log = log or (lambda message: None)
    self._fd: int | None = None

  @staticmethod
  def _owner(text: str) -> dict[str, Any]:
    try:
      owner = json.loads(text)
    except ValueError:
      return {}
    return owner if isinstance(owner, dict) else {}

  def _refuse(self, owner: Mapping[str, Any], hint: str = "") -> None:
    raise RunLockedError(
        f"{self.directory} is in use by another trainer: pid "
        f"{owner.get('pid', '?')} on host {owner.get('host', '?')} since "
        f"{owner.get('since', '?')} (lock {self.path}); wait for it to end or "
        f"use another run_name{hint}")

  def acquire(self) -> "RunLock":
    if self._fd is not None:
      return self
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise _storage_error("the lock file", self.path, e) or StorageError(
          f"cannot create the lock file {self.path}: {e.strerror or e}"
      ) from e
    try:
      previous = self._owner(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
      host = socket.gethostname()
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        self._refuse(previous)
      except OSError as e:  # No flock on this file system.
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
          raise
        if previous and (previous.get("host") != host
                         or _pid_alive(int(previous.get("pid", 0)))):
          self._refuse(previous, f" (no flock on this file system: remove "
                       f"{self.path} if that process is gone)")
      if previous and previous.get("pid") is not None:
        alive = (previous.get("host") == host
                 and _pid_alive(int(previous.get("pid", 0))))
        self._log(
            f"note: took over {self.path} from pid {previous.get('pid')} on "
            f"host {previous.get('host')} (since {previous.get('since')}), "
            f"which {'no longer holds it' if alive else 'is no longer running'}")
      record = json.dumps({
          "host": host, "pid": os.getpid(),
          "since": datetime.datetime.now().isoformat(timespec="seconds"),
          "what": self.what}).encode()
      os.ftruncate(fd, 0)
      os.pwrite(fd, record + b"\n", 0)
      os.fsync(fd)
    except BaseException as e:
      os.close(fd)
      if isinstance(e, OSError):
        raise _storage_error("the lock file", self.path, e) or e
      raise
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)
    except OSError:
      pass
    finally:
      os.close(fd)  # Drops the flock.

  def __enter__(self) -> "RunLock":
    return self.acquire()

  def __exit__(self, *exc_info) -> None:
    self.release()


# ---- Run names -----------------------------------------------------------


def default_run_name(config: config_lib.Config,
                     now: datetime.datetime | None = None) -> str:
  """`<model_name>-<YYYYmmdd-HHMMSS>`, with `-2`, `-3`... if that run's
  directory already exists, so separate runs never resume each other.
  Process 0's clock and file system decide, for every process."""
  now = now or datetime.datetime.now()
  stamp = _from_primary([int(now.timestamp())])[0]
  stem = (f"{config.model_name}-"
          f"{datetime.datetime.fromtimestamp(stamp):%Y%m%d-%H%M%S}")

  def name(n: int) -> str:
    return stem if n == 1 else f"{stem}-{n}"

  n = 1
  if _is_primary():
    while os.path.exists(os.path.join(config.base_output_directory, name(n))):
      n += 1
  return name(_from_primary([n])[0])


def with_default_run_name(config: config_lib.Config) -> config_lib.Config:
  """`config` with a fresh timestamped `run_name` when it is empty (the
  default); an explicit `run_name` is kept, so naming a run resumes it."""
  if config.run_name:
    return config
  return config.replace(run_name=default_run_name(config))


# ---- State layout and config comparison -----------------------------------


def state_layout(tree: Any) -> dict[str, str]:
  """{'params/decoder/...': 'float32[64,256]'} for arrays or
  ShapeDtypeStructs."""
  layout = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    shape = ",".join(str(d) for d in leaf.shape)
    layout[name] = f"{np.dtype(leaf.dtype).name}[{shape}]"
  return layout


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
  """`values` as they read back from JSON (tuples as lists, ...)."""
  return json.loads(json.dumps(dict(values)))


def config_differences(saved: Mapping[str, Any],
                       current: Mapping[str, Any]) -> list[str]:
  """['base_emb_dim: 64 in the checkpoint, 128 now', ...] over the keys that
  are not RUN_KEYS."""
  saved, current = _plain(saved), _plain(current)
  differences = []
  for key in sorted(set(saved) | set(current)):
    if key in RUN_KEYS or saved.get(key) == current.get(key):
      continue
    old = repr(saved[key]) if key in saved else "(absent)"
    new = repr(current[key]) if key in current else "(absent)"
    differences.append(f"{key}: {old} in the checkpoint, {new} now")
  return differences


def layout_differences(saved: Mapping[str, str],
                       current: Mapping[str, str]) -> list[str]:
  """Arrays that are missing, new, or of another dtype/shape."""
  differences = []
  for name in sorted(set(saved) | set(current)):
    old, new = saved.get(name, "absent"), current.get(name, "absent")
    if old != new:
      differences.append(f"{name}: {old} in the checkpoint, {new} now")
  return differences


# ---- Sealing and verifying a step directory --------------------------------


def _file_digest(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(_HASH_CHUNK_BYTES), b""):
      digest.update(chunk)
  return digest.hexdigest()


def _step_files(step_dir: str) -> list[str]:
  """Paths of the step's files relative to it, sorted, without the
  integrity record."""
  files = []
  for root, _, names in os.walk(step_dir):
    for name in names:
      relative = os.path.relpath(os.path.join(root, name), step_dir)
      if relative != INTEGRITY_FILE and not name.startswith(
          f".{INTEGRITY_FILE}"):
        files.append(relative.replace(os.sep, "/"))
  return sorted(files)


def _write_json_atomically(path: str, data: Any) -> None:
  partial = os.path.join(os.path.dirname(path),
                         f".{os.path.basename(path)}.partial")
  with open(partial, "w") as f:
    json.dump(data, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(partial, path)


def seal_step(step_dir: str, step: int, layout: Mapping[str, str],
              config: Mapping[str, Any]) -> None:
  """Writes `integrity.json` for a step orbax has finalized."""
  files = _step_files(step_dir)
  missing = [name for name in REQUIRED_FILES if name not in files]
  if missing:
    raise CheckpointError(
        f"checkpoint step {step} at {step_dir}: orbax finalized it without "
        f"{missing[0]}; not sealing it")
  record = {
      "format": INTEGRITY_FORMAT,
      "step": step,
      "files": {name: {"size": os.path.getsize(os.path.join(step_dir, name)),
                       "sha256": _file_digest(os.path.join(step_dir, name))}
                for name in files},
      "state": dict(layout),
      "config": _plain(config),
  }
  _write_json_atomically(os.path.join(step_dir, INTEGRITY_FILE), record)


def read_integrity_record(step_dir: str) -> dict[str, Any]:
  with open(os.path.join(step_dir, INTEGRITY_FILE)) as f:
    return json.load(f)


def read_orbax_step_metadata(step_dir: str) -> dict[str, Any] | None:
  """orbax's `_CHECKPOINT_METADATA` of a step (or unfinished save), or None
  where it is missing or unreadable."""
  try:
    with open(os.path.join(step_dir, ORBAX_STEP_METADATA)) as f:
      metadata = json.load(f)
  except (OSError, ValueError):
    return None
  return metadata if isinstance(metadata, dict) else None


def owner_marker(step_dir: str) -> dict[str, Any] | None:
  """This trainer's marker in orbax's step metadata ({"format", "step",
  "state", "config"}), or None: not written by this trainer (or by a version
  before the marker)."""
  metadata = read_orbax_step_metadata(step_dir) or {}
  custom = metadata.get("custom_metadata")
  marker = custom.get(OWNER_KEY) if isinstance(custom, dict) else None
  if (isinstance(marker, dict) and isinstance(marker.get("state"), dict)
      and isinstance(marker.get("config"), dict)):
    return marker
  return None


def is_own_step(step_dir: str) -> bool:
  """A real directory (not a link) that this trainer wrote: it holds the
  integrity record or this trainer's marker."""
  if os.path.islink(step_dir) or not os.path.isdir(step_dir):
    return False
  return (os.path.isfile(os.path.join(step_dir, INTEGRITY_FILE))
          or owner_marker(step_dir) is not None)


def _is_own_unfinished_save(path: str) -> bool:
  """An orbax temporary directory of this trainer: its marker, or (killed
  before orbax added the marker to its metadata) nothing but orbax's own
  entries and no one else's custom metadata."""
  if os.path.islink(path) or not os.path.isdir(path):
    return False
  if owner_marker(path) is not None:
    return True
  if not set(os.listdir(path)) <= _ORBAX_ENTRIES:
    return False
  # orbax first writes its metadata with empty custom_metadata, and adds
  # ours when the save's items are written.
  metadata = read_orbax_step_metadata(path)
  return metadata is None or not metadata.get("custom_metadata")


def _step_of(step_dir: str) -> int | None:
  name = os.path.basename(os.path.normpath(step_dir))
  return int(name) if _STEP_NAME.match(name) else None


def verify_step(step_dir: str) -> str | None:
  """What is wrong with a step directory, or None if every file it was
  sealed with is there with its size and sha256, the record lists orbax's
  required files, and no file on disk is missing from the record."""
  if os.path.islink(step_dir) or not os.path.isdir(step_dir):
    return "missing: not a directory"
  files = _step_files(step_dir)
  record_path = os.path.join(step_dir, INTEGRITY_FILE)
  if not os.path.exists(record_path):
    if not files:
      return "empty: the directory holds no files"
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
      return f"incomplete: {missing[0]} is missing (and it was never sealed)"
    return (f"unsealed: no {INTEGRITY_FILE} (orbax wrote it, but its run "
            "stopped before sealing it)")
  try:
    record = read_integrity_record(step_dir)
  except (OSError, ValueError) as e:
    return f"damaged: {INTEGRITY_FILE} is unreadable ({type(e).__name__}: {e})"
  if not (isinstance(record, dict) and isinstance(record.get("files"), dict)
          and {"state", "config"} <= set(record)):
    return f"damaged: {INTEGRITY_FILE} lacks its file list, state or config"
  recorded = record["files"]
  if not all(isinstance(meta, dict) and {"size", "sha256"} <= set(meta)
             for meta in recorded.values()):
    return f"damaged: {INTEGRITY_FILE} has a malformed file entry"
  unlisted_required = [name for name in REQUIRED_FILES if name not in recorded]
  if unlisted_required:
    return (f"damaged: {INTEGRITY_FILE} does not list {unlisted_required[0]}"
            f" ({len(recorded)} files listed)")
  step = _step_of(step_dir)
  if step is not None and record.get("step") != step:
    return (f"damaged: {INTEGRITY_FILE} is the record of step "
            f"{record.get('step')!r}, not of step {step}")
  # Cheap checks first: a missing or unlisted file is named before any
  # hashing.
  for name, meta in sorted(recorded.items()):
    path = os.path.join(step_dir, name)
    if not os.path.isfile(path):
      return f"incomplete: {name} is missing"
    size = os.path.getsize(path)
    if size != meta["size"]:
      return (f"damaged: {name} has {size} bytes, {meta['size']} when it was "
              "saved")
  unlisted = [name for name in files if name not in recorded]
  if unlisted:
    more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
    return (f"damaged: {unlisted[0]} is on disk but not in {INTEGRITY_FILE}"
            f"{more}")
  for name, meta in sorted(recorded.items()):
    if _file_digest(os.path.join(step_dir, name)) != meta["sha256"]:
      return f"damaged: {name} does not match its sha256 from the save"
  return None


def unsealed_step_problem(step_dir: str) -> str | None:
  """For a step without an integrity record: what says that orbax did not
  finish it or that it is not this trainer's, or None when orbax's own
  completeness holds (commit marker, commit timestamp, required files) and
  its metadata files read. Its data is checked by restoring it."""
  files = _step_files(step_dir)
  if not files:
    return "empty: the directory holds no files"
  missing = [name for name in REQUIRED_FILES if name not in files]
  if missing:
    return f"incomplete: {missing[0]} is missing (and it was never sealed)"
  marker = owner_marker(step_dir)
  if marker is None:
    return (f"unsealed: no {INTEGRITY_FILE} and no marker of this trainer in "
            f"{ORBAX_STEP_METADATA}")
  metadata = read_orbax_step_metadata(step_dir) or {}
  if not isinstance(metadata.get("commit_timestamp_nsecs"), int):
    return (f"incomplete: orbax did not finish it (no commit timestamp in "
            f"{ORBAX_STEP_METADATA})")
  if ORBAX_COMMIT_FILE not in files:
    return f"incomplete: orbax did not finish it (no {ORBAX_COMMIT_FILE})"
  step = _step_of(step_dir)
  if step is not None and marker.get("step") != step:
    return (f"damaged: its marker is of step {marker.get('step')!r}, not of "
            f"step {step}")
  for name in files:
    path = os.path.join(step_dir, name)
    if os.path.islink(path) or not os.path.isfile(path):
      return f"damaged: {name} is not a regular file"
  try:
    with open(os.path.join(step_dir, "default", "_METADATA")) as f:
      json.load(f)
  except (OSError, ValueError) as e:
    return f"damaged: default/_METADATA is unreadable ({type(e).__name__})"
  return None


# ---- The checkpointer -------------------------------------------------------


def _set_aside(path: str, suffix: str) -> str:
  """Renames `path` to `<path><suffix>` (or `-2`, `-3`, ...); returns it."""
  target, n = f"{path}{suffix}", 1
  while os.path.lexists(target):
    n += 1
    target = f"{path}{suffix}-{n}"
  os.rename(path, target)
  return target


def _kind_of_entry(path: str) -> str:
  if os.path.islink(path):
    return "a symbolic link"
  if os.path.isdir(path):
    return "a directory this trainer did not write"
  if os.path.isfile(path):
    return "a regular file"
  return "not a directory"


class Checkpointer:
  """Saves every `checkpoint_period` steps (and the last one), keeps the
  newest `max_num_checkpoints_to_keep` sealed steps, restores the newest
  intact one.

  Checkpoint step N holds the state after N training steps.

  Opening the directory checks that it can be written (`StorageError`),
  takes its `writer.lock` (`RunLockedError` while another live process holds
  it), removes this trainer's unfinished saves and sets aside entries named
  like steps that it did not write. `close` releases the lock.

  Args:
    config: the run's resolved config (also stored with each checkpoint).
    directory: default: `config.checkpoint_directory`.
    log: where the one-line reports go (damaged steps moved aside, removed
      unfinished saves, keys changed on resume); default: print on process 0.
  """

  def __init__(self, config: config_lib.Config, directory: str | None = None,
               *, log: Callable[[str], None] | None = _print_on_process_0):
    if directory is None and not config.checkpoint_dir:
      config = with_default_run_name(config)
    self.config = config
    self.period = config.checkpoint_period
    self.max_to_keep = config.max_num_checkpoints_to_keep
    self._log = log or (lambda message: None)
    self._pending: list[tuple[int, dict[str, str]]] = []
    self._wrote_run_config = False
    self._lock: RunLock | None = None
    directory = os.path.abspath(directory or config.checkpoint_directory)
    error = None
    if _is_primary():
      try:
        check_writable_directory(directory, "checkpoint directory")
        self._lock = RunLock(directory, what="checkpoints",
                             log=self._log).acquire()
        self._tidy(directory)
      except (CheckpointError, OSError) as e:
        if self._lock is not None:
          self._lock.release()
        error = e
    if _from_primary([int(error is not None)])[0]:
      if error is None:
        raise CheckpointError(f"process 0 could not open {directory} for "
                              "checkpoints (its output says why)")
      if isinstance(error, OSError):
        raise _storage_error("the checkpoint directory", directory,
                             error) or error
      raise error
    _sync("opened")
    # The period is applied in `save` rather than by orbax's save policy,
    # which would also save the first step it is shown; rotation is `_rotate`
    # (orbax's max_to_keep would count unverified steps).
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None, enable_async_checkpointing=config.async_checkpointing,
        create=True)
    try:
      self.manager = ocp.CheckpointManager(directory, options=options)
    except BaseException:
      if self._lock is not None:
        self._lock.release()
      raise

  @property
  def directory(self) -> str:
    return str(self.manager.directory)

  def step_directory(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def should_save(self, step: int, *, last: bool = False) -> bool:
    return last or step % self.period == 0

  # -- opening --

  def _tidy(self, directory: str) -> None:
    """Process 0, before orbax sees the directory: removes own unfinished
    saves and half-deleted steps; sets aside what is named like a step or an
    unfinished save but is not this trainer's directory."""
    for name in sorted(os.listdir(directory)):
      path = os.path.join(directory, name)
      if _UNFINISHED_NAME.match(name):
        if _is_own_unfinished_save(path):
          shutil.rmtree(path)
          self._log(f"removed an unfinished save (its run was stopped while "
                    f"saving): {path}")
        else:
          self._set_aside_foreign(path)
      elif _DELETING_NAME.match(name) and not os.path.islink(path) and (
          os.path.isdir(path)):
        shutil.rmtree(path)
        self._log(f"removed {path}: an old step a stopped run had started "
                  "to delete")
      elif _STEP_NAME.match(name) and (os.path.islink(path)
                                       or not os.path.isdir(path)):
        self._set_aside_foreign(path)

  def _set_aside_foreign(self, path: str) -> str:
    kind = _kind_of_entry(path)
    moved = _set_aside(path, FOREIGN_SUFFIX)
    self._log(f"{path} is named like a checkpoint but is {kind}; moved it "
              f"to {moved} (nothing deleted)")
    return moved

  # -- saving --

  def save(self, step: int, state: Any, *, last: bool = False) -> bool:
    """Saves `state` as `step` if the period says so or it is the `last`.

    A synchronous save is sealed (and older steps rotated out) before this
    returns; an asynchronous one at the first `poll` after orbax finishes it,
    or when the next save starts, or at `wait_until_finished`.
    """
    if not self.should_save(step, last=last):
      return False
    self._finish_pending_saves()
    step_dir = self.step_directory(step)
    if _is_primary() and os.path.lexists(step_dir) and (
        not is_own_step(step_dir)):
      # orbax would replace it: a user's file or directory.
      self._set_aside_foreign(step_dir)
    _sync("cleared")
    layout = state_layout(state)
    marker = {"format": INTEGRITY_FORMAT, "step": step, "state": layout,
              "config": _plain(self.config.to_dict())}
    try:
      saved = self.manager.save(step, args=ocp.args.StandardSave(state),
                                force=True, custom_metadata={OWNER_KEY: marker})
    except Exception as e:  # pylint: disable=broad-except
      error = _storage_error(f"checkpoint step {step} to", step_dir, e)
      if error is None:
        raise
      raise error from e
    if saved:
      self._pending.append((step, layout))
      if not self.config.async_checkpointing:
        self._finish_pending_saves()
    return saved

  def poll(self) -> None:
    """Seals the asynchronous saves orbax has finished (cheap when none is
    pending; the trainer calls it after every step)."""
    if not self._pending:
      return
    if _from_primary([int(not self.manager.is_saving_in_progress())])[0]:
      self._finish_pending_saves()

  def _finish_pending_saves(self) -> None:
    """Waits for orbax, seals what it finalized, then rotates."""
    if not self._pending:
      return
    pending, self._pending = self._pending, []
    steps = ", ".join(str(step) for step, _ in pending)
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      error = _storage_error(f"checkpoint step {steps} to", self.directory, e)
      raise (error or CheckpointError(
          f"checkpoint step {steps} in {self.directory} was not saved: "
          f"{type(e).__name__}: {_first_line(e)}")) from e
    if _is_primary():
      for step, layout in pending:
        try:
          seal_step(self.step_directory(step), step, layout,
                    self.config.to_dict())
        except OSError as e:
          raise _storage_error(f"the {INTEGRITY_FILE} of checkpoint step {step}"
                               " to", self.step_directory(step), e) or e
      try:
        self._write_run_config()
      except OSError as e:
        raise _storage_error(RUN_CONFIG_FILE + " to", self.directory, e) or e
    _sync("sealed")
    self._rotate()

  def _write_run_config(self) -> None:
    if self._wrote_run_config:
      return
    with open(os.path.join(self.directory, RUN_CONFIG_FILE), "w") as f:
      f.write(f"# The resolved config of the run that wrote the newest "
              f"checkpoint here (each step's {INTEGRITY_FILE} holds its "
              "own).\n")
      yaml.safe_dump(_plain(self.config.to_dict()), f, sort_keys=False)
    self._wrote_run_config = True

  def _is_sealed(self, step: int) -> bool:
    return os.path.exists(os.path.join(self.step_directory(step),
                                       INTEGRITY_FILE))

  def _rotate(self) -> None:
    """Deletes this trainer's steps older than the newest `max_to_keep`
    sealed ones.

    Unsealed steps newer than those (a save in flight) are left alone, and
    the newest sealed step, verified when it was sealed, is always kept.
    Steps this trainer did not write are never deleted. A step is renamed to
    `<step>.deleting` before it is deleted, so a stopped deletion leaves no
    half step behind.
    """
    self.manager.reload()
    steps = self.all_steps()
    sealed = [step for step in steps if self._is_sealed(step)]
    if not sealed:
      return
    oldest_kept = sealed[-self.max_to_keep:][0]
    deleted = False
    if _is_primary():
      for step in steps:
        step_dir = self.step_directory(step)
        if step < oldest_kept and is_own_step(step_dir):
          try:
            shutil.rmtree(_set_aside(step_dir, DELETING_SUFFIX))
          except OSError as e:
            self._log(f"could not delete old checkpoint step {step} at "
                      f"{step_dir}: {e}")
          deleted = True
    if _from_primary([int(deleted)])[0]:
      _sync("rotated")
      self.manager.reload()

  # -- restoring --

  def _move_aside(self, step: int) -> str:
    source = self.step_directory(step)
    return _set_aside(source, DAMAGED_SUFFIX if is_own_step(source)
                      else FOREIGN_SUFFIX)

  def _examine(self, steps: list[int]
               ) -> tuple[int, bool, list[tuple[int, str, bool]]]:
    """Process 0: (the newest step to restore, whether it still has to be
    sealed, [(newer bad step, its problem, whether it was sealed)])."""
    problems = []
    for step in reversed(steps):
      step_dir = self.step_directory(step)
      sealed = os.path.isfile(os.path.join(step_dir, INTEGRITY_FILE))
      if not sealed and is_own_step(step_dir):
        problem = unsealed_step_problem(step_dir)
        if problem is None:
          return step, True, problems
      else:
        problem = verify_step(step_dir)
        if problem is None:
          return step, False, problems
      problems.append((step, problem, sealed))
    return -1, False, problems

  def _report_and_move(self, problems: list[tuple[int, str, bool]],
                       then: str) -> None:
    for step, problem, _ in problems:
      owner = ("" if is_own_step(self.step_directory(step))
               else " and not written by this trainer")
      moved = self._move_aside(step)
      self._log(f"checkpoint step {step} at {self.step_directory(step)} "
                f"is {problem}{owner}; moved it to {moved}, {then}")

  def _newest_intact_step(self, steps: list[int]) -> tuple[int, bool]:
    """Verifies steps from the newest down; reports and moves aside the
    newer bad ones once an intact one is found. (-1, False) where no step
    was sealed and none can be (all moved aside: start from scratch).
    Raises NoIntactCheckpointError (moving nothing) where sealed steps exist
    and every one is damaged."""
    chosen, adopt, problems = -1, False, []
    if _is_primary():
      chosen, adopt, problems = self._examine(steps)
      if chosen >= 0:
        self._report_and_move(problems, f"resuming from step {chosen}")
      elif not any(sealed for _, _, sealed in problems):
        self._report_and_move(problems, "starting from scratch")
    chosen, adopt, refused = _from_primary(
        [chosen, int(adopt),
         int(chosen < 0 and any(sealed for _, _, sealed in problems))])
    _sync("verified")
    if refused:
      listed = "; ".join(f"step {step}: {problem}"
                         for step, problem, _ in problems) or "see process 0"
      raise NoIntactCheckpointError(
          f"no intact checkpoint in {self.directory} ({listed}); nothing was "
          "moved or deleted: start another run (another run_name or "
          "checkpoint_dir) or remove the directory")
    self.manager.reload()
    return chosen, bool(adopt)

  def _check_compatible(self, step: int, record: Mapping[str, Any],
                        abstract_state: Any) -> None:
    """Refuses a checkpoint of another model; reports other changed keys."""
    changed = config_differences(record["config"], self.config.to_dict())
    arrays = layout_differences(record["state"], state_layout(abstract_state))
    if arrays:
      keys = "; ".join(changed) or "no config key differs"
      more = f" (and {len(arrays) - 1} more)" if len(arrays) > 1 else ""
      raise IncompatibleCheckpointError(
          f"checkpoint step {step} in {self.directory} holds another model "
          f"than this config: {keys}; its state differs at {arrays[0]}{more}."
          " Use another run_name (or checkpoint_dir) for this config, or "
          f"resume with the checkpoint's config ({RUN_CONFIG_FILE} there)")
    if changed:
      self._log(f"resuming step {step} with changed config keys: "
                + "; ".join(changed))

  def restore_latest(self, abstract_state: Any) -> tuple[int | None, Any]:
    """(step, state) of the newest intact checkpoint, or (None, None) if the
    directory holds no step that can be resumed (steps that were never
    sealed and fail their checks are moved aside first, saying so).

    A step orbax finished but that was never sealed is restored, and sealed
    if that works; if not, it is moved aside and the next older step tried.

    `abstract_state` is a tree of `jax.ShapeDtypeStruct` with shardings: the
    restored arrays are laid out as the current mesh wants them (another
    mesh is fine: orbax reshards).
    """
    while True:
      steps = self.all_steps()
      if not steps:
        return None, None
      step, adopt = self._newest_intact_step(steps)
      if step < 0:
        return None, None
      step_dir = self.step_directory(step)
      record = owner_marker(step_dir) if adopt else read_integrity_record(
          step_dir)
      self._check_compatible(step, record, abstract_state)
      try:
        state = self.manager.restore(
            step, args=ocp.args.StandardRestore(abstract_state))
        failed = 0
      except Exception as e:  # pylint: disable=broad-except
        if not adopt:
          raise CheckpointError(
              f"checkpoint step {step} at {step_dir} matches its checksums "
              f"but orbax could not restore it: {type(e).__name__}: "
              f"{_first_line(e)}") from e
        failed, error = 1, e
      if not _from_primary([failed])[0]:
        if adopt:
          if _is_primary():
            seal_step(step_dir, step, record["state"], record["config"])
            self._log(
                f"checkpoint step {step} at {step_dir} was finished by orbax "
                f"but not sealed (its run stopped in between): its files "
                f"are complete and it restores, so it is sealed now; "
                f"resuming from step {step}")
          _sync("adopted")
        return step, state
      if _is_primary():
        moved = _set_aside(step_dir, DAMAGED_SUFFIX)
        cause = (f"{type(error).__name__}: {_first_line(error)}" if failed
                 else "see process 0")
        self._log(f"checkpoint step {step} at {step_dir} is damaged: orbax "
                  f"finished it but it does not restore ({cause}); moved it "
                  f"to {moved}")
      _sync("adoption_failed")
      self.manager.reload()

  # -- lifecycle --

  def wait_until_finished(self) -> None:
    """Finishes (and seals) every save started so far."""
    self._finish_pending_saves()
    self.manager.wait_until_finished()

  def close(self) -> None:
    try:
      self._finish_pending_saves()
    finally:
      try:
        self.manager.close()
      finally:
        if self._lock is not None:
          self._lock.release()
