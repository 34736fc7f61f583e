"""Saves checkpoint step 1 of a small state and SIGKILLs itself at one named
phase of that save (tests/host/test_checkpoint_kills.py runs it).

  python checkpoint_kill_child.py CHECKPOINT_DIR PHASE ASYNC(0|1)

The kill is injected by wrapping the function that runs at the phase, so it
lands at the same point every time.
"""
import os
import signal
import time
import sys

import host_test_utils  # pylint: disable=unused-import  (sys.path)

import jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity

from reference_host import checkpoint as checkpoint_lib
from reference_host import config as config_lib
from host_test_utils import BASE_CONFIG, TEST_MODEL_ARGS

PHASES = (
    # before orbax is called: nothing on disk
    "before_orbax",
    # orbax wrote the step's temporary directory, before its commit file,
    # commit timestamp and rename
    "orbax_finalizing",
    # orbax renamed the step directory; the trainer has not sealed it
    "orbax_renamed",
    # integrity.json's partial file is written, not yet renamed into place
    "sealing",
    # sealed; the run's config.yml and the rotation not done yet
    "sealed",
)


def state():
  return {"w": jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) / 7,
          "step": jnp.asarray(1, jnp.int32)}


def config(directory, async_save):
  return config_lib.load_config(
      [BASE_CONFIG, *TEST_MODEL_ARGS, f"checkpoint_dir={directory}",
       "checkpoint_period=1", f"async_checkpointing={async_save}"])


def _die():
  sys.stdout.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def _inject(phase):
  if phase == "before_orbax":
    save = checkpoint_lib.ocp.CheckpointManager.save
    checkpoint_lib.ocp.CheckpointManager.save = (
        lambda *a, **k: _die() or save(*a, **k))
  elif phase in ("orbax_finalizing", "orbax_renamed"):
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def wrapped(self):
      step_level = self.get_final().name.isdigit()
      if step_level and phase == "orbax_finalizing":
        _die()
      await finalize(self)
      if step_level and phase == "orbax_renamed":
        _die()

    atomicity.AtomicRenameTemporaryPath.finalize = wrapped
  elif phase == "sealing":
    def write_partial_and_die(path, data):
      partial = os.path.join(os.path.dirname(path),
                             f".{os.path.basename(path)}.partial")
      with open(partial, "w") as f:
        f.write(str(data)[:100])
      _die()
    checkpoint_lib._write_json_atomically = write_partial_and_die  # pylint: disable=protected-access
  elif phase == "sealed":
    checkpoint_lib.Checkpointer._write_run_config = lambda self: _die()  # pylint: disable=protected-access
  else:
    raise ValueError(phase)


def main(directory, phase, async_save):
  checkpointer = checkpoint_lib.Checkpointer(config(directory, async_save),
                                             log=print)
  _inject(phase)
  checkpointer.save(1, state())
  # Training goes on: step boundaries poll until the save is sealed.
  for _ in range(2000):
    checkpointer.poll()
    if not checkpointer._pending:  # pylint: disable=protected-access
      break
    time.sleep(0.005)
  checkpointer.close()
  print("no kill happened")


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], sys.argv[3] == "1")
