"""SIGKILL at every phase of a run's first save, synchronous and
asynchronous; each restart succeeds: it resumes from the step when orbax had
finished it (sealing it now), else starts from scratch, saying which, and can
then save again. A crash in that window used to brick the run ("no intact
checkpoint ... remove the directory" on every start)."""
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from reference_host import checkpoint as checkpoint_lib

from host_test_utils import REPO_ROOT
import checkpoint_kill_child as child

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                     "checkpoint_kill_child.py")
# Where orbax had renamed step 1 when the kill came: the restart resumes it.
FINISHED_BY_ORBAX = ("orbax_renamed", "sealing", "sealed")


def _kill_during_first_save(directory, phase, async_save):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [os.path.join(REPO_ROOT, "plugin"), os.path.join(REPO_ROOT, "host")]
      + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  run = subprocess.run(
      [sys.executable, CHILD, directory, phase, str(int(async_save))],
      env=env, capture_output=True, text=True, timeout=120)
  assert run.returncode == -signal.SIGKILL, run.stdout + run.stderr
  return run


def _abstract_state():
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
      child.state())


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("phase", child.PHASES)
def test_restart_after_a_kill_in_the_first_save_succeeds(tmp_path, phase,
                                                         async_save):
  directory = str(tmp_path / "checkpoints")
  _kill_during_first_save(directory, phase, async_save)

  messages = []
  checkpointer = checkpoint_lib.Checkpointer(
      child.config(directory, async_save), log=messages.append)
  step, state = checkpointer.restore_latest(_abstract_state())
  # The killed run's lock is free (the kernel dropped it): taken over.
  assert messages[0].startswith(
      f"note: took over {directory}/{checkpoint_lib.LOCK_FILE} from pid ")
  assert messages[0].endswith("which is no longer running")
  messages = messages[1:]
  if phase in FINISHED_BY_ORBAX:
    assert step == 1, messages
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state),
                 jax.device_get(child.state()))
    if phase != "sealed":
      assert len(messages) == 1, messages
      assert "was finished by orbax but not sealed" in messages[0]
      assert "resuming from step 1" in messages[0]
    assert checkpoint_lib.verify_step(checkpointer.step_directory(1)) is None
  else:
    assert (step, state) == (None, None), messages
    if phase == "orbax_finalizing":
      assert messages == [
          "removed an unfinished save (its run was stopped while saving): "
          f"{directory}/1{checkpoint_lib.UNFINISHED_SAVE_MARKER}"]
  # The run goes on: its next save works and is sealed.
  next_step = 2 if step == 1 else 1
  checkpointer.save(next_step, child.state())
  checkpointer.close()
  assert checkpointer.all_steps()[-1] == next_step
  for saved in checkpointer.all_steps():
    assert checkpoint_lib.verify_step(
        checkpointer.step_directory(saved)) is None
  assert not [name for name in os.listdir(directory)
              if checkpoint_lib.UNFINISHED_SAVE_MARKER in name]
