"""Storage failures: a full disk, a read-only or unwritable directory, a path
under a file. Each is one line naming the path and the cause, found before
the first step where it can be; after space is freed the run resumes
exactly.

A real small tmpfs gives real ENOSPC / EROFS where this process may mount
(root with CAP_SYS_ADMIN, as CI runs); elsewhere the same errors are
injected (a non-root chmod, or a patched write)."""
import contextlib
import errno
import os
import subprocess

import jax
import numpy as np
import pytest

import collective_matmul as cm
from reference_host import checkpoint as checkpoint_lib
from reference_host import config as config_lib
from reference_host import trainer as trainer_lib

from host_test_utils import BASE_CONFIG, TEST_MODEL_ARGS

OFF = cm.CollectiveMatmulConfig(enabled=False)


def _config(checkpoint_dir, **overrides):
  args = [BASE_CONFIG, *TEST_MODEL_ARGS, "ici_tensor_sequence_parallelism=4",
          "steps=6", "checkpoint_period=2", "max_num_checkpoints_to_keep=2",
          "init_weights_seed=3", "data_shuffle_seed=5",
          f"checkpoint_dir={checkpoint_dir}"]
  args += [f"{k}={v}" for k, v in overrides.items()]
  return config_lib.load_config(args)


@contextlib.contextmanager
def tmpfs(path, options):
  """A tmpfs at `path` (yields True), or nothing mounted (yields False)
  where this process may not mount."""
  os.makedirs(path, exist_ok=True)
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs",
                            str(path)], capture_output=True,
                           check=False).returncode == 0
  try:
    yield mounted
  finally:
    if mounted:
      subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory):
  """Writes a file until the file system is full; returns its path. (A file
  system found full already, at the open or at the close, is full too: a
  CI run once found the tmpfs full at the open.)"""
  path = os.path.join(directory, "filler")
  try:
    with open(path, "wb") as f:
      while True:
        f.write(b"\xff" * (1 << 16))
        f.flush()
  except OSError as e:
    assert e.errno == errno.ENOSPC, e
  return path


@pytest.fixture(scope="module")
def continuous(tmp_path_factory):
  trainer = trainer_lib.Trainer(
      _config(tmp_path_factory.mktemp("unused") / "c"), OFF)
  result = trainer.train(trainer.init_state(), log=None)
  return {"trainer": trainer, "losses": result.losses,
          "state": jax.tree.map(np.asarray, result.state)}


def test_full_disk_is_one_line_and_the_run_resumes_after_space_is_freed(
    continuous, tmp_path, monkeypatch):
  """The disk fills after checkpoint 2: saving 4 fails with one line naming
  the path and 'No space left on device (ENOSPC)'. Once space is freed, the
  next start removes the unfinished save, resumes from 2, and trains steps
  2..5 exactly as the uninterrupted run did."""
  disk = tmp_path / "disk"
  with tmpfs(disk, "size=16m") as mounted:
    directory = str(disk / "checkpoints")
    trainer = trainer_lib.Trainer(_config(directory), OFF)
    checkpointer = checkpoint_lib.Checkpointer(trainer.config, log=None)
    filler = []

    def fill_after_checkpoint_2(record):
      if record.step == 2:
        if mounted:
          filler.append(_fill(str(disk)))
        else:  # What TensorStore raises on a full disk, injected.
          def full(*args, **kwargs):
            raise ValueError(
                'RESOURCE_EXHAUSTED: Error writing "params" in OCDBT database '
                f'at local file "{directory}/4.orbax-checkpoint-tmp": '
                "Failed to write 65536 bytes to file 7: No space left on "
                "device [os_error_code='28']")
          monkeypatch.setattr(checkpoint_lib.ocp.CheckpointManager, "save",
                              full)

    with pytest.raises(checkpoint_lib.StorageError) as raised:
      trainer.train(trainer.init_state(), checkpointer=checkpointer, log=None,
                    on_record=fill_after_checkpoint_2)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"cannot write checkpoint step 4 to {directory}")
    assert message.endswith("No space left on device (ENOSPC)")
    with contextlib.suppress(checkpoint_lib.CheckpointError):
      checkpointer.close()
    for path in filler:  # Space is freed.
      if os.path.exists(path):
        os.remove(path)
    monkeypatch.undo()

    messages = []
    checkpointer = checkpoint_lib.Checkpointer(trainer.config,
                                               log=messages.append)
    state, step = trainer.restore_or_init(checkpointer)
    assert step == 2, messages
    resumed = trainer.train(state, checkpointer=checkpointer, log=None)
    checkpointer.close()
    np.testing.assert_array_equal(resumed.losses, continuous["losses"][2:])
    jax.tree.map(np.testing.assert_array_equal,
                 jax.tree.map(np.asarray, resumed.state), continuous["state"])
    assert checkpointer.all_steps() == [4, 6]


def test_read_only_checkpoint_directory_is_found_before_the_first_step(
    continuous, tmp_path, monkeypatch):
  """It used to be found at the first save, after a whole period of
  training, as a 70-86 line traceback."""
  readonly = tmp_path / "readonly"
  with tmpfs(readonly, "ro,size=1m") as mounted:
    directory = str(readonly / "run" / "checkpoints")
    if mounted:
      cause = "Read-only file system (EROFS)"
    elif os.geteuid() != 0:
      os.chmod(readonly, 0o555)
      cause = "Permission denied (EACCES)"
    else:  # root without a mount: chmod would not stop root.
      makedirs = os.makedirs

      def read_only(path, *args, **kwargs):
        if str(path).startswith(str(readonly)):
          raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return makedirs(path, *args, **kwargs)
      monkeypatch.setattr(checkpoint_lib.os, "makedirs", read_only)
      cause = "Read-only file system (EROFS)"
    trainer = continuous["trainer"]
    with pytest.raises(checkpoint_lib.StorageError) as raised:
      checkpoint_lib.Checkpointer(
          trainer.config.replace(checkpoint_dir=directory), log=None)
    assert str(raised.value) == (
        f"cannot write to the checkpoint directory {directory}: {cause}")


def test_checkpoint_directory_under_a_file_is_one_line(continuous, tmp_path):
  (tmp_path / "a_file").write_text("not a directory")
  directory = str(tmp_path / "a_file" / "checkpoints")
  with pytest.raises(checkpoint_lib.StorageError) as raised:
    checkpoint_lib.Checkpointer(
        continuous["trainer"].config.replace(checkpoint_dir=directory),
        log=None)
  assert str(raised.value) == (
      f"cannot use {directory} as the checkpoint directory: "
      f"{tmp_path / 'a_file'} is a file, not a directory (ENOTDIR)")


@pytest.mark.parametrize("text", [
    "Failed to write 65536 bytes to file 7: No space left on device "
    "[os_error_code='28']",
    # asyncio's "exception was never retrieved" shows the failed write
    # inside the future's repr, quotes escaped: it must still be known as
    # a full disk, or its traceback reaches the user (a flaky CI run).
    "_GatheringFuture exception was never retrieved\nfuture: "
    "<_GatheringFuture finished exception=ValueError('RESOURCE_EXHAUSTED: "
    "Failed to write 108676 bytes to file 19: No space left on device "
    "[os_error_code=\\'28\\']')>"])
def test_a_full_disk_is_recognised_in_tensorstores_text(text):
  assert checkpoint_lib.storage_cause(RuntimeError(text)) == (
      "No space left on device (ENOSPC)")
