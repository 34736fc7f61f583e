"""orbax checkpoints of the train state: periodic save, verified resume, keep N.

The train state holds plain arrays, so a checkpoint does not record whether it
was written with the collective matmul on or off; restoring into the same
abstract state (shapes, dtypes, shardings) works either way.

Every step is *sealed* once orbax has finalized it: `integrity.json` in the
step directory records the size and sha256 of each of its files, the state's
layout (path -> dtype[shape]) and the resolved config of the run. A restore
verifies steps from the newest down: a step that is empty, incomplete, damaged
or was never sealed is reported in one line, moved aside to `<step>.damaged`
(orbax no longer sees it, and its step can be saved again), and the newest
intact step is restored; with none, `NoIntactCheckpointError`. A checkpoint
whose state layout differs from this run's (another model) is refused with
`IncompatibleCheckpointError`, naming the config keys that differ.

Rotation is done here rather than by orbax's `max_to_keep`: it keeps the
newest `max_num_checkpoints_to_keep` sealed steps and deletes only steps older
than those, so the newest verified checkpoint is never deleted. Unfinished
saves (`*.orbax-checkpoint-tmp*`, left by a killed run) are removed when a
Checkpointer opens the directory.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
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
# Files orbax writes into every finalized StandardSave step.
REQUIRED_FILES = ("_CHECKPOINT_METADATA", "default/_METADATA",
                  "default/manifest.ocdbt")
# Keys that describe the run rather than the state: they may change on resume
# and are not reported (mesh_axis_sizes follows the ici_* keys, which are).
RUN_KEYS = frozenset({
    "run_name", "base_output_directory", "checkpoint_dir", "steps",
    "log_period", "enable_checkpointing", "checkpoint_period",
    "max_num_checkpoints_to_keep", "async_checkpointing", "mesh_axis_sizes",
})
_HASH_CHUNK_BYTES = 1 << 22


class CheckpointError(RuntimeError):
  """A checkpoint directory that cannot be resumed as it is."""


class NoIntactCheckpointError(CheckpointError):
  """Every step in the directory is empty, incomplete, damaged or unsealed."""


class IncompatibleCheckpointError(CheckpointError):
  """The newest intact checkpoint holds a different model than the config."""


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


def verify_step(step_dir: str) -> str | None:
  """What is wrong with a step directory, or None if every file it was
  sealed with is there with its size and sha256."""
  if not os.path.isdir(step_dir):
    return "missing: not a directory"
  files = _step_files(step_dir)
  record_path = os.path.join(step_dir, INTEGRITY_FILE)
  if not os.path.exists(record_path):
    if not files:
      return "empty: the directory holds no files"
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
      return f"incomplete: {missing[0]} is missing (and it was never sealed)"
    return (f"unverified: no {INTEGRITY_FILE} (its save did not finish, or "
            "an older version of this host wrote it)")
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
  # Cheap checks first: a missing file is named before any hashing.
  for name, meta in sorted(recorded.items()):
    path = os.path.join(step_dir, name)
    if not os.path.isfile(path):
      return f"incomplete: {name} is missing"
    size = os.path.getsize(path)
    if size != meta["size"]:
      return (f"damaged: {name} has {size} bytes, {meta['size']} when it was "
              "saved")
  for name, meta in sorted(recorded.items()):
    if _file_digest(os.path.join(step_dir, name)) != meta["sha256"]:
      return f"damaged: {name} does not match its sha256 from the save"
  return None


# ---- The checkpointer -------------------------------------------------------


class Checkpointer:
  """Saves every `checkpoint_period` steps (and the last one), keeps the
  newest `max_num_checkpoints_to_keep` sealed steps, restores the newest
  intact one.

  Checkpoint step N holds the state after N training steps.

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
    directory = os.path.abspath(directory or config.checkpoint_directory)
    self._remove_unfinished_saves(directory)
    # The period is applied in `save` rather than by orbax's save policy,
    # which would also save the first step it is shown; rotation is `_rotate`
    # (orbax's max_to_keep would count unverified steps).
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None, enable_async_checkpointing=config.async_checkpointing,
        create=True)
    self.manager = ocp.CheckpointManager(directory, options=options)

  @property
  def directory(self) -> str:
    return str(self.manager.directory)

  def step_directory(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def should_save(self, step: int, *, last: bool = False) -> bool:
    return last or step % self.period == 0

  # -- saving --

  def save(self, step: int, state: Any, *, last: bool = False) -> bool:
    """Saves `state` as `step` if the period says so or it is the `last`.

    A synchronous save is sealed (and older steps rotated out) before this
    returns; an asynchronous one when the next save starts or at
    `wait_until_finished`.
    """
    if not self.should_save(step, last=last):
      return False
    self._finish_pending_saves()
    saved = self.manager.save(step, args=ocp.args.StandardSave(state),
                              force=True)
    if saved:
      self._pending.append((step, state_layout(state)))
      if not self.config.async_checkpointing:
        self._finish_pending_saves()
    return saved

  def _finish_pending_saves(self) -> None:
    """Waits for orbax, seals what it finalized, then rotates."""
    if not self._pending:
      return
    self.manager.wait_until_finished()
    pending, self._pending = self._pending, []
    if _is_primary():
      for step, layout in pending:
        seal_step(self.step_directory(step), step, layout,
                  self.config.to_dict())
      self._write_run_config()
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
    """Deletes the steps older than the newest `max_to_keep` sealed ones.

    Unsealed steps newer than those (a save in flight) are left alone, and
    the newest sealed step, verified when it was sealed, is always kept.
    """
    self.manager.reload()
    steps = self.all_steps()
    sealed = [step for step in steps if self._is_sealed(step)]
    if not sealed:
      return
    oldest_kept = sealed[-self.max_to_keep:][0]
    for step in steps:
      if step < oldest_kept:
        self.manager.delete(step)

  # -- restoring --

  def _remove_unfinished_saves(self, directory: str) -> None:
    if _is_primary() and os.path.isdir(directory):
      for name in sorted(os.listdir(directory)):
        if UNFINISHED_SAVE_MARKER in name:
          shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
          self._log(f"removed an unfinished save (its run was stopped while "
                    f"saving): {os.path.join(directory, name)}")
    _sync("removed_unfinished_saves")

  def _move_aside(self, step: int) -> str:
    source = self.step_directory(step)
    target, n = f"{source}{DAMAGED_SUFFIX}", 1
    while os.path.exists(target):
      n += 1
      target = f"{source}{DAMAGED_SUFFIX}-{n}"
    os.rename(source, target)
    return target

  def _newest_intact_step(self, steps: list[int]) -> int:
    """Verifies steps from the newest down; reports and moves aside the
    newer bad ones once an intact one is found. Raises
    NoIntactCheckpointError (moving nothing) if there is none."""
    chosen, problems = -1, []
    if _is_primary():
      for step in reversed(steps):
        problem = verify_step(self.step_directory(step))
        if problem is None:
          chosen = step
          break
        problems.append((step, problem))
      if chosen >= 0:
        for step, problem in problems:
          moved = self._move_aside(step)
          self._log(f"checkpoint step {step} at {self.step_directory(step)} "
                    f"is {problem}; moved it to {moved}, resuming from step "
                    f"{chosen}")
    chosen = _from_primary([chosen])[0]
    _sync("verified")
    if chosen < 0:
      listed = "; ".join(f"step {step}: {problem}"
                         for step, problem in problems) or "see process 0"
      raise NoIntactCheckpointError(
          f"no intact checkpoint in {self.directory} ({listed}); nothing was "
          "moved or deleted: start another run (another run_name or "
          "checkpoint_dir) or remove the directory")
    if problems or jax.process_count() > 1:
      self.manager.reload()
    return chosen

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
    directory holds no step at all.

    `abstract_state` is a tree of `jax.ShapeDtypeStruct` with shardings: the
    restored arrays are laid out as the current mesh wants them (another
    mesh is fine: orbax reshards).
    """
    steps = self.all_steps()
    if not steps:
      return None, None
    step = self._newest_intact_step(steps)
    self._check_compatible(
        step, read_integrity_record(self.step_directory(step)), abstract_state)
    try:
      state = self.manager.restore(
          step, args=ocp.args.StandardRestore(abstract_state))
    except Exception as e:  # pylint: disable=broad-except
      first_line = (str(e).strip().splitlines() or [""])[0]
      raise CheckpointError(
          f"checkpoint step {step} at {self.step_directory(step)} matches its "
          f"checksums but orbax could not restore it: {type(e).__name__}: "
          f"{first_line}") from e
    return step, state

  # -- lifecycle --

  def wait_until_finished(self) -> None:
    """Finishes (and seals) every save started so far."""
    self._finish_pending_saves()
    self.manager.wait_until_finished()

  def close(self) -> None:
    try:
      self._finish_pending_saves()
    finally:
      self.manager.close()
