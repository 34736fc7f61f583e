"""Damaged, incomplete and foreign checkpoints, NaN losses, run names.

One run saves steps 2, 4 and 6 (keeping 2: steps 4 and 6 stay); each test
damages a copy of its checkpoint directory the way issue 15 measured it and
restores from that copy.
"""
import dataclasses
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml

import collective_matmul as cm
from reference_host import checkpoint as checkpoint_lib
from reference_host import config as config_lib
from reference_host import trainer as trainer_lib

from host_test_utils import BASE_CONFIG, TEST_MODEL_ARGS

OFF = cm.CollectiveMatmulConfig(enabled=False)
TOTAL_STEPS = 6
PERIOD = 2
KEEP = 2


def _config(checkpoint_dir, **overrides):
  args = [BASE_CONFIG, *TEST_MODEL_ARGS, "ici_tensor_sequence_parallelism=4",
          f"steps={TOTAL_STEPS}", f"checkpoint_period={PERIOD}",
          f"max_num_checkpoints_to_keep={KEEP}", "init_weights_seed=7",
          "data_shuffle_seed=11", f"checkpoint_dir={checkpoint_dir}"]
  args += [f"{k}={v}" for k, v in overrides.items()]
  return config_lib.load_config(args)


def _host_copy(state):
  return jax.tree.map(np.asarray, state)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
  """Steps 0..5 in two calls, saving 2, 4, 6; the states at 4 and 6 and
  every loss of the continuous run."""
  directory = tmp_path_factory.mktemp("saved") / "checkpoints"
  trainer = trainer_lib.Trainer(_config(directory), OFF)
  checkpointer = checkpoint_lib.Checkpointer(trainer.config, log=None)
  first = trainer.train(trainer.init_state(), 4, checkpointer=checkpointer,
                        log=None)
  state_4 = _host_copy(first.state)
  second = trainer.train(first.state, checkpointer=checkpointer, log=None)
  checkpointer.close()
  return {"directory": str(directory), "trainer": trainer,
          "states": {4: state_4, 6: _host_copy(second.state)},
          "losses": first.losses + second.losses}


def _copy_of(saved_run, tmp_path) -> str:
  directory = str(tmp_path / "checkpoints")
  shutil.copytree(saved_run["directory"], directory)
  return directory


def _largest_file(step_dir: str) -> str:
  files = [os.path.join(root, name) for root, _, names in os.walk(step_dir)
           for name in names if name != checkpoint_lib.INTEGRITY_FILE]
  return max(files, key=os.path.getsize)


def _overwrite_64_bytes(path: str) -> None:
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.seek(max(0, size // 2 - 32))
    f.write(bytes(range(64)))


def _damage(directory: str, how: str) -> None:
  newest = os.path.join(directory, "6")
  if how == "corrupt_data":
    _overwrite_64_bytes(_largest_file(newest))
  elif how == "empty_newer_step":
    os.makedirs(os.path.join(directory, "8"))
  elif how == "no_metadata":
    os.remove(os.path.join(newest, "default", "_METADATA"))
  elif how == "no_manifest":
    os.remove(os.path.join(newest, "default", "manifest.ocdbt"))
  elif how == "corrupt_record":
    _overwrite_64_bytes(os.path.join(newest, checkpoint_lib.INTEGRITY_FILE))
  elif how == "unsealed":
    os.remove(os.path.join(newest, checkpoint_lib.INTEGRITY_FILE))
  else:
    raise ValueError(how)


def _restore(trainer, directory, messages=None, **overrides):
  """Restores from `directory` with `trainer`'s config, or, given overrides,
  with a new trainer's for that config."""
  if overrides:
    trainer = trainer_lib.Trainer(_config(directory, **overrides), OFF)
  checkpointer = checkpoint_lib.Checkpointer(
      trainer.config, directory,
      log=None if messages is None else messages.append)
  step, state = checkpointer.restore_latest(trainer.abstract_state)
  return checkpointer, step, state


def _assert_same_state(actual, expected):
  jax.tree.map(np.testing.assert_array_equal, _host_copy(actual), expected)


# (damage, the bad step, what the report says, the step restored, where the
# bad step goes: `.damaged` for this trainer's steps, `.foreign` for a
# directory it did not write)
DAMAGES = [
    ("corrupt_data", 6, "does not match its sha256", 4, "damaged"),
    ("empty_newer_step", 8, "empty", 6, "foreign"),
    ("no_metadata", 6, "default/_METADATA is missing", 4, "damaged"),
    ("no_manifest", 6, "default/manifest.ocdbt is missing", 4, "damaged"),
    ("corrupt_record", 6, "integrity.json is unreadable", 4, "damaged"),
]


@pytest.mark.parametrize("how, bad_step, problem, restored_step, aside",
                         DAMAGES, ids=[d[0] for d in DAMAGES])
def test_bad_newest_step_is_reported_moved_aside_and_previous_restored(
    saved_run, tmp_path, how, bad_step, problem, restored_step, aside):
  directory = _copy_of(saved_run, tmp_path)
  _damage(directory, how)
  messages = []
  checkpointer, step, state = _restore(saved_run["trainer"], directory,
                                       messages)
  assert step == restored_step
  _assert_same_state(state, saved_run["states"][restored_step])
  bad_dir = os.path.join(directory, str(bad_step))
  assert len(messages) == 1, messages
  assert f"checkpoint step {bad_step} at {bad_dir} is" in messages[0]
  assert problem in messages[0]
  assert f"resuming from step {restored_step}" in messages[0]
  assert os.path.isdir(f"{bad_dir}.{aside}")
  assert bad_step not in checkpointer.all_steps()


def test_corrupt_newest_falls_back_and_continues_like_a_continuous_run(
    saved_run, tmp_path):
  """Issue 15's D4: 64 bytes overwritten in the newest step's largest data
  file. The run resumes from step 4, trains steps 4 and 5 exactly as the
  continuous run did, and every step left verifies."""
  directory = _copy_of(saved_run, tmp_path)
  _overwrite_64_bytes(_largest_file(os.path.join(directory, "6")))
  trainer = saved_run["trainer"]
  checkpointer, step, state = _restore(trainer, directory, [])
  assert step == 4
  resumed = trainer.train(state, checkpointer=checkpointer, log=None)
  checkpointer.close()
  np.testing.assert_array_equal(resumed.losses, saved_run["losses"][4:])
  _assert_same_state(resumed.state, saved_run["states"][6])
  assert checkpointer.all_steps() == [4, 6]
  for step in checkpointer.all_steps():
    assert checkpoint_lib.verify_step(
        os.path.join(directory, str(step))) is None


def test_no_intact_checkpoint_is_a_clear_error_that_moves_nothing(
    saved_run, tmp_path):
  directory = _copy_of(saved_run, tmp_path)
  _overwrite_64_bytes(_largest_file(os.path.join(directory, "6")))
  os.remove(os.path.join(directory, "4", "default", "_METADATA"))
  with pytest.raises(checkpoint_lib.NoIntactCheckpointError) as raised:
    _restore(saved_run["trainer"], directory, [])
  message = str(raised.value)
  assert f"no intact checkpoint in {directory}" in message
  assert "step 6: damaged" in message and "step 4: incomplete" in message
  assert sorted(os.listdir(directory)) == [
      "4", "6", "config.yml", checkpoint_lib.LOCK_FILE]


def test_resume_with_another_model_is_refused_naming_the_keys(
    saved_run, tmp_path):
  directory = _copy_of(saved_run, tmp_path)
  with pytest.raises(checkpoint_lib.IncompatibleCheckpointError) as raised:
    _restore(saved_run["trainer"], directory, [], base_num_decoder_layers=2)
  message = str(raised.value)
  assert directory in message
  assert "base_num_decoder_layers: 1 in the checkpoint, 2 now" in message
  assert "layers_1" in message  # the first array the checkpoint lacks
  assert sorted(os.listdir(directory)) == [
      "4", "6", "config.yml", checkpoint_lib.LOCK_FILE]


def test_resume_on_another_mesh_reshards_and_reports_the_change(
    saved_run, tmp_path):
  directory = _copy_of(saved_run, tmp_path)
  messages = []
  _, step, state = _restore(saved_run["trainer"], directory, messages,
                            ici_tensor_sequence_parallelism=2)
  assert step == 6
  _assert_same_state(state, saved_run["states"][6])
  assert len(messages) == 1, messages
  assert ("ici_tensor_sequence_parallelism: 4 in the checkpoint, 2 now"
          in messages[0])


def test_config_is_saved_with_the_run_and_each_step(saved_run):
  directory = saved_run["directory"]
  config = saved_run["trainer"].config
  with open(os.path.join(directory, checkpoint_lib.RUN_CONFIG_FILE)) as f:
    saved = yaml.safe_load(f)
  assert saved["base_num_decoder_layers"] == config.base_num_decoder_layers
  assert saved["mesh_axis_sizes"] == config.mesh_axis_sizes
  record = checkpoint_lib.read_integrity_record(os.path.join(directory, "6"))
  assert record["config"]["base_emb_dim"] == config.base_emb_dim
  assert record["step"] == 6


def test_rotation_counts_only_sealed_steps(saved_run, tmp_path):
  """A stray unsealed step newer than the sealed ones does not push the
  newest verified checkpoint out (orbax's max_to_keep would: it keeps the
  newest two directories, 7 and 8, and deletes 6)."""
  directory = _copy_of(saved_run, tmp_path)
  stray = os.path.join(directory, "7")
  shutil.copytree(os.path.join(directory, "6"), stray)
  if os.path.exists(os.path.join(stray, checkpoint_lib.INTEGRITY_FILE)):
    os.remove(os.path.join(stray, checkpoint_lib.INTEGRITY_FILE))
  trainer = saved_run["trainer"]
  checkpointer = checkpoint_lib.Checkpointer(trainer.config, directory,
                                             log=None)
  state = jax.device_put(saved_run["states"][6], trainer.state_shardings)
  checkpointer.save(8, state)
  checkpointer.close()
  assert checkpointer.all_steps() == [6, 7, 8]
  assert checkpoint_lib.verify_step(os.path.join(directory, "6")) is None


def test_a_step_that_cannot_be_sealed_deletes_nothing(saved_run, tmp_path,
                                                      monkeypatch):
  directory = _copy_of(saved_run, tmp_path)
  trainer = saved_run["trainer"]
  checkpointer = checkpoint_lib.Checkpointer(trainer.config, directory,
                                             log=None)
  monkeypatch.setattr(checkpoint_lib, "REQUIRED_FILES",
                      (*checkpoint_lib.REQUIRED_FILES, "never_written"))
  state = jax.device_put(saved_run["states"][6], trainer.state_shardings)
  with pytest.raises(checkpoint_lib.CheckpointError, match="never_written"):
    checkpointer.save(8, state)
  assert checkpointer.all_steps() == [4, 6, 8]


def test_async_saves_are_sealed_and_rotated(saved_run, tmp_path):
  trainer = saved_run["trainer"]
  checkpointer = checkpoint_lib.Checkpointer(
      trainer.config.replace(async_checkpointing=True),
      str(tmp_path / "checkpoints"), log=None)
  result = trainer.train(trainer.init_state(), checkpointer=checkpointer,
                         log=None)
  np.testing.assert_array_equal(result.losses, saved_run["losses"])
  assert checkpointer.all_steps() == [4, 6]
  for step in checkpointer.all_steps():
    assert checkpoint_lib.verify_step(checkpointer.step_directory(step)) is None
  _, state = checkpointer.restore_latest(trainer.abstract_state)
  _assert_same_state(state, saved_run["states"][6])


def test_unfinished_save_is_removed_at_the_next_start(saved_run, tmp_path):
  directory = _copy_of(saved_run, tmp_path)
  unfinished = os.path.join(directory, "8.orbax-checkpoint-tmp-1234")
  shutil.copytree(os.path.join(directory, "6"), unfinished)
  messages = []
  _, step, _ = _restore(saved_run["trainer"], directory, messages)
  assert step == 6
  assert not os.path.exists(unfinished)
  assert messages == [
      f"removed an unfinished save (its run was stopped while saving): "
      f"{unfinished}"]


def test_nan_loss_stops_before_anything_is_saved(saved_run, tmp_path,
                                                 monkeypatch):
  trainer = saved_run["trainer"]
  run_step = trainer_lib.Trainer.run_step

  def nan_at_step_3(self, state, step):
    state, record = run_step(self, state, step)
    if step == 3:
      record = dataclasses.replace(record, loss=float("nan"))
    return state, record

  monkeypatch.setattr(trainer_lib.Trainer, "run_step", nan_at_step_3)
  checkpointer = checkpoint_lib.Checkpointer(
      trainer.config, str(tmp_path / "checkpoints"), log=None)
  with pytest.raises(trainer_lib.NonFiniteError) as raised:
    trainer.train(trainer.init_state(), checkpointer=checkpointer, log=None)
  assert raised.value.step == 3
  assert str(raised.value).startswith(
      "loss is nan at step 3: stopped before saving anything from it "
      "(newest checkpoint: step 2 in ")
  # Checkpoint 4 (the state after step 3) is not written.
  assert checkpointer.all_steps() == [2]


def test_diverging_run_stops_before_saving_non_finite_values(tmp_path):
  """A huge learning rate: the loss or the updated state turns non-finite;
  every checkpoint written before that is intact and finite."""
  trainer = trainer_lib.Trainer(
      _config(tmp_path / "checkpoints", learning_rate=1e30,
              checkpoint_period=1, max_num_checkpoints_to_keep=10, steps=5),
      OFF)
  checkpointer = checkpoint_lib.Checkpointer(trainer.config, log=None)
  with pytest.raises(trainer_lib.NonFiniteError) as raised:
    trainer.train(trainer.init_state(), checkpointer=checkpointer, log=None)
  bad_step = raised.value.step
  assert f"step {bad_step} " in str(raised.value)
  # Checkpoint N is the state after N steps: the one after bad_step is not.
  assert checkpointer.all_steps() == list(range(1, bad_step + 1))
  _, state = checkpointer.restore_latest(trainer.abstract_state)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(_host_copy(state)))


def test_non_finite_state_is_not_saved(saved_run, tmp_path):
  trainer = saved_run["trainer"]
  checkpointer = checkpoint_lib.Checkpointer(
      trainer.config, str(tmp_path / "checkpoints"), log=None)
  state = jax.device_put(saved_run["states"][6], trainer.state_shardings)
  state["params"]["decoder_norm"]["scale"] = (
      state["params"]["decoder_norm"]["scale"] * np.inf)
  with pytest.raises(trainer_lib.NonFiniteError,
                     match="params/decoder_norm/scale"):
    # pylint: disable-next=protected-access
    trainer._check_finite_state(state, 6, checkpointer)


def test_default_run_name_is_fresh_and_explicit_name_is_kept(tmp_path):
  config = _config("", base_output_directory=str(tmp_path), run_name="")
  named = checkpoint_lib.with_default_run_name(config)
  assert named.run_name.startswith("tiny-")
  now = datetime.datetime(2025, 1, 30, 12, 5, 1)
  assert (checkpoint_lib.default_run_name(config, now)
          == "tiny-20250130-120501")
  os.makedirs(tmp_path / "tiny-20250130-120501")
  assert (checkpoint_lib.default_run_name(config, now)
          == "tiny-20250130-120501-2")
  explicit = config.replace(run_name="mine")
  assert checkpoint_lib.with_default_run_name(explicit).run_name == "mine"


def test_base_config_has_no_fixed_run_name():
  assert config_lib.load_config([BASE_CONFIG]).run_name == ""


# ---- Issue 33: unsealed steps, verification against the disk, foreign
# entries, async sealing, the writer lock, storage errors.


def _data_files(step_dir: str) -> list[str]:
  """The step's OCDBT data files (what a restore reads)."""
  return [os.path.join(root, name) for root, _, names in os.walk(step_dir)
          for name in names if os.sep + "d" + os.sep in
          os.path.join(root, name)[len(step_dir):] + os.sep]


def test_finished_but_unsealed_step_is_verified_sealed_and_restored(
    saved_run, tmp_path):
  """Killed after orbax renamed step 6 but before integrity.json: the step
  is checked by its content, sealed, and resumed from (it used to be set
  aside as 'its save did not finish', and a first step so left bricked the
  run)."""
  directory = _copy_of(saved_run, tmp_path)
  step_dir = os.path.join(directory, "6")
  os.remove(os.path.join(step_dir, checkpoint_lib.INTEGRITY_FILE))
  messages = []
  checkpointer, step, state = _restore(saved_run["trainer"], directory,
                                       messages)
  assert step == 6
  _assert_same_state(state, saved_run["states"][6])
  assert len(messages) == 1, messages
  assert (f"checkpoint step 6 at {step_dir} was finished by orbax but not "
          "sealed") in messages[0]
  assert "resuming from step 6" in messages[0]
  assert "did not finish" not in messages[0]
  assert checkpoint_lib.verify_step(step_dir) is None
  assert checkpointer.all_steps() == [4, 6]


def test_unsealed_step_that_does_not_restore_is_set_aside(saved_run,
                                                          tmp_path):
  directory = _copy_of(saved_run, tmp_path)
  step_dir = os.path.join(directory, "6")
  os.remove(os.path.join(step_dir, checkpoint_lib.INTEGRITY_FILE))
  for path in _data_files(step_dir):
    os.truncate(path, 0)
  messages = []
  checkpointer, step, state = _restore(saved_run["trainer"], directory,
                                       messages)
  assert step == 4
  _assert_same_state(state, saved_run["states"][4])
  assert any(f"checkpoint step 6 at {step_dir} is damaged: orbax finished "
             "it but it does not restore" in m for m in messages), messages
  assert os.path.isdir(step_dir + checkpoint_lib.DAMAGED_SUFFIX)
  assert checkpointer.all_steps() == [4]


def test_run_whose_only_step_was_never_sealed_and_is_bad_starts_clean(
    saved_run, tmp_path):
  """No sealed step and none can be: start from scratch, saying so, with
  the bad step set aside (it used to be NoIntactCheckpointError forever)."""
  directory = _copy_of(saved_run, tmp_path)
  shutil.rmtree(os.path.join(directory, "4"))
  step_dir = os.path.join(directory, "6")
  os.remove(os.path.join(step_dir, checkpoint_lib.INTEGRITY_FILE))
  os.remove(os.path.join(step_dir, "commit_success.txt"))  # orbax's
  messages = []
  checkpointer, step, state = _restore(saved_run["trainer"], directory,
                                       messages)
  assert (step, state) == (None, None)
  assert len(messages) == 1, messages
  assert "orbax did not finish it" in messages[0]
  assert "starting from scratch" in messages[0]
  assert os.path.isdir(step_dir + checkpoint_lib.DAMAGED_SUFFIX)
  assert checkpointer.all_steps() == []


def test_record_listing_no_files_does_not_pass(saved_run, tmp_path):
  """Issue 33's case: 64 bytes flipped in step 6 and its record's file list
  emptied. It used to verify, and the run continued from corrupted state."""
  directory = _copy_of(saved_run, tmp_path)
  step_dir = os.path.join(directory, "6")
  _overwrite_64_bytes(_largest_file(step_dir))
  record = checkpoint_lib.read_integrity_record(step_dir)
  record["files"] = {}
  # pylint: disable-next=protected-access
  checkpoint_lib._write_json_atomically(
      os.path.join(step_dir, checkpoint_lib.INTEGRITY_FILE), record)
  problem = checkpoint_lib.verify_step(step_dir)
  assert problem is not None and "does not list" in problem, problem
  messages = []
  _, step, state = _restore(saved_run["trainer"], directory, messages)
  assert step == 4
  _assert_same_state(state, saved_run["states"][4])
  assert "integrity.json does not list" in messages[0]


def test_file_on_disk_but_not_in_the_record_is_reported(saved_run, tmp_path):
  directory = _copy_of(saved_run, tmp_path)
  step_dir = os.path.join(directory, "6")
  with open(os.path.join(step_dir, "default", "extra.bin"), "wb") as f:
    f.write(b"not saved by orbax")
  problem = checkpoint_lib.verify_step(step_dir)
  assert problem == ("damaged: default/extra.bin is on disk but not in "
                     "integrity.json")
  messages = []
  _, step, _ = _restore(saved_run["trainer"], directory, messages)
  assert step == 4
  assert "default/extra.bin is on disk but not in integrity.json" in (
      messages[0])


def test_files_named_like_steps_are_set_aside_never_overwritten(
    saved_run, tmp_path):
  """A user's regular file `checkpoints/8` (the next step) and `5`: each is
  reported and renamed to `.foreign` with its content; step 8 is saved."""
  directory = _copy_of(saved_run, tmp_path)
  for name in ("5", "8"):
    with open(os.path.join(directory, name), "w") as f:
      f.write(f"user's notes {name}")
  trainer = saved_run["trainer"]
  messages = []
  checkpointer = checkpoint_lib.Checkpointer(trainer.config, directory,
                                             log=messages.append)
  state = jax.device_put(saved_run["states"][6], trainer.state_shardings)
  checkpointer.save(8, state)
  checkpointer.close()
  for name in ("5", "8"):
    path = os.path.join(directory, name)
    assert any(f"{path} is named like a checkpoint but is a regular file; "
               f"moved it to {path}.foreign" in m for m in messages), messages
    with open(path + checkpoint_lib.FOREIGN_SUFFIX) as f:
      assert f.read() == f"user's notes {name}"
  assert checkpointer.all_steps() == [6, 8]
  assert checkpoint_lib.verify_step(os.path.join(directory, "8")) is None


def test_rotation_and_cleanup_delete_only_what_this_trainer_wrote(
    saved_run, tmp_path):
  """A directory `3` and an unfinished-save name that this trainer did not
  write survive rotation and the start-up cleanup."""
  directory = _copy_of(saved_run, tmp_path)
  foreign_step = os.path.join(directory, "3")
  os.makedirs(os.path.join(foreign_step, "default"))
  with open(os.path.join(foreign_step, "default", "mine.txt"), "w") as f:
    f.write("a user's directory")
  foreign_tmp = os.path.join(directory, "9.orbax-checkpoint-tmp-5")
  os.makedirs(foreign_tmp)
  with open(os.path.join(foreign_tmp, "notes.txt"), "w") as f:
    f.write("not orbax's")
  trainer = saved_run["trainer"]
  messages = []
  checkpointer = checkpoint_lib.Checkpointer(trainer.config, directory,
                                             log=messages.append)
  state = jax.device_put(saved_run["states"][6], trainer.state_shardings)
  checkpointer.save(8, state)
  checkpointer.close()
  assert os.path.isfile(os.path.join(foreign_step, "default", "mine.txt"))
  assert not os.path.exists(os.path.join(directory, "4"))  # its own: rotated
  assert os.path.isfile(os.path.join(
      foreign_tmp + checkpoint_lib.FOREIGN_SUFFIX, "notes.txt"))
  assert checkpointer.all_steps() == [3, 6, 8]


def test_async_save_is_sealed_at_the_first_step_boundary_after_it_finishes(
    saved_run, tmp_path):
  """It used to be sealed only when the next save started: a kill in
  between left a finished step unsealed (and the first one bricked the
  run)."""
  trainer = saved_run["trainer"]
  checkpointer = checkpoint_lib.Checkpointer(
      trainer.config.replace(async_checkpointing=True),
      str(tmp_path / "checkpoints"), log=None)
  sealed_before_the_next_save = []

  def on_record(record):
    if record.step == 2:  # Step 2's save is in flight: let orbax finish.
      checkpointer.manager.wait_until_finished()
    if record.step == 3:  # After the boundary of step 2, before save 4.
      sealed_before_the_next_save.append(checkpoint_lib.verify_step(
          checkpointer.step_directory(2)))

  trainer.train(trainer.init_state(), 4, checkpointer=checkpointer,
                log=None, on_record=on_record)
  checkpointer.close()
  assert sealed_before_the_next_save == [None]


def test_second_writer_is_refused_naming_the_owner(saved_run, tmp_path):
  directory = str(tmp_path / "checkpoints")
  trainer = saved_run["trainer"]
  first = checkpoint_lib.Checkpointer(trainer.config, directory, log=None)
  with pytest.raises(checkpoint_lib.RunLockedError) as raised:
    checkpoint_lib.Checkpointer(trainer.config, directory, log=None)
  message = str(raised.value)
  assert "\n" not in message
  assert (f"{directory} is in use by another trainer: pid {os.getpid()} on "
          f"host {socket.gethostname()}") in message
  first.close()
  checkpoint_lib.Checkpointer(trainer.config, directory, log=None).close()


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_note(
    saved_run, tmp_path):
  directory = tmp_path / "checkpoints"
  directory.mkdir()
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  dead_pid = int(dead.stdout)
  (directory / checkpoint_lib.LOCK_FILE).write_text(json.dumps(
      {"host": socket.gethostname(), "pid": dead_pid,
       "since": "2025-01-30T12:00:00"}))
  messages = []
  checkpointer = checkpoint_lib.Checkpointer(
      saved_run["trainer"].config, str(directory), log=messages.append)
  assert messages == [
      f"note: took over {directory / checkpoint_lib.LOCK_FILE} from pid "
      f"{dead_pid} on host {socket.gethostname()} (since "
      "2025-01-30T12:00:00), which is no longer running"]
  owner = json.loads((directory / checkpoint_lib.LOCK_FILE).read_text())
  assert owner["pid"] == os.getpid()
  checkpointer.close()
  assert (directory / checkpoint_lib.LOCK_FILE).read_text() == ""


def test_unfinished_save_killed_before_orbax_added_the_marker_is_removed(
    saved_run, tmp_path):
  """orbax writes its step metadata first with empty custom_metadata and
  adds this trainer's marker later: a kill in between leaves an own
  unfinished save, removed (not set aside as foreign)."""
  directory = _copy_of(saved_run, tmp_path)
  unfinished = os.path.join(directory, "8.orbax-checkpoint-tmp")
  os.makedirs(unfinished)
  with open(os.path.join(unfinished, "_CHECKPOINT_METADATA"), "w") as f:
    json.dump({"item_handlers": None, "metrics": {},
               "init_timestamp_nsecs": 1, "commit_timestamp_nsecs": None,
               "custom_metadata": {}}, f)
  messages = []
  _, step, _ = _restore(saved_run["trainer"], directory, messages)
  assert step == 6
  assert messages == [
      f"removed an unfinished save (its run was stopped while saving): "
      f"{unfinished}"]
  assert sorted(os.listdir(directory)) == [
      "4", "6", "config.yml", checkpoint_lib.LOCK_FILE]
