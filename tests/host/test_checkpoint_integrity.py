"""Damaged, incomplete and foreign checkpoints, NaN losses, run names.

One run saves steps 2, 4 and 6 (keeping 2: steps 4 and 6 stay); each test
damages a copy of its checkpoint directory the way issue 15 measured it and
restores from that copy.
"""
import dataclasses
import datetime
import os
import shutil

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


# (damage, the bad step, what the report says, the step restored)
DAMAGES = [
    ("corrupt_data", 6, "does not match its sha256", 4),
    ("empty_newer_step", 8, "empty", 6),
    ("no_metadata", 6, "default/_METADATA is missing", 4),
    ("no_manifest", 6, "default/manifest.ocdbt is missing", 4),
    ("unsealed", 6, "no integrity.json", 4),
    ("corrupt_record", 6, "integrity.json is unreadable", 4),
]


@pytest.mark.parametrize("how, bad_step, problem, restored_step", DAMAGES,
                         ids=[d[0] for d in DAMAGES])
def test_bad_newest_step_is_reported_moved_aside_and_previous_restored(
    saved_run, tmp_path, how, bad_step, problem, restored_step):
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
  assert os.path.isdir(bad_dir + checkpoint_lib.DAMAGED_SUFFIX)
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
  assert sorted(os.listdir(directory)) == ["4", "6", "config.yml"]


def test_resume_with_another_model_is_refused_naming_the_keys(
    saved_run, tmp_path):
  directory = _copy_of(saved_run, tmp_path)
  with pytest.raises(checkpoint_lib.IncompatibleCheckpointError) as raised:
    _restore(saved_run["trainer"], directory, [], base_num_decoder_layers=2)
  message = str(raised.value)
  assert directory in message
  assert "base_num_decoder_layers: 1 in the checkpoint, 2 now" in message
  assert "layers_1" in message  # the first array the checkpoint lacks
  assert sorted(os.listdir(directory)) == ["4", "6", "config.yml"]


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
