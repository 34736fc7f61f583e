"""Checkpoints restore across the flag, and training continues unchanged."""
import numpy as np
import pytest

import collective_matmul as cm
from reference_host import checkpoint as checkpoint_lib
from reference_host import config as config_lib
from reference_host import trainer as trainer_lib

from host_test_utils import BASE_CONFIG, TEST_MODEL_ARGS

OFF = cm.CollectiveMatmulConfig(enabled=False)
ON = cm.CollectiveMatmulConfig(enabled=True, impl="ring")
TOTAL_STEPS = 4
SAVED_AT = 2


@pytest.fixture(scope="module")
def seeds():
  rng = np.random.default_rng()
  return {"init_weights_seed": int(rng.integers(1 << 30)),
          "data_shuffle_seed": int(rng.integers(1 << 30))}


def _config(seeds, tmp_path=None, **overrides):
  args = [BASE_CONFIG, *TEST_MODEL_ARGS, "ici_tensor_sequence_parallelism=4",
          f"steps={TOTAL_STEPS}", f"checkpoint_period={SAVED_AT}"]
  args += [f"{k}={v}" for k, v in {**seeds, **overrides}.items()]
  if tmp_path is not None:
    args.append(f"checkpoint_dir={tmp_path}")
  return config_lib.load_config(args)


@pytest.fixture(scope="module")
def uninterrupted_losses(seeds):
  trainer = trainer_lib.Trainer(_config(seeds), OFF)
  return trainer.train(trainer.init_state(), log=None).losses


@pytest.mark.parametrize("save_with, resume_with",
                         [(OFF, ON), (ON, OFF)], ids=["off_to_on", "on_to_off"])
def test_resumed_run_matches_uninterrupted_run(
    seeds, uninterrupted_losses, tmp_path, save_with, resume_with):
  config = _config(seeds, tmp_path)
  first = trainer_lib.Trainer(config, save_with)
  checkpointer = checkpoint_lib.Checkpointer(first.config)
  first.train(first.init_state(), SAVED_AT, checkpointer=checkpointer,
              log=None)
  checkpointer.close()

  second = trainer_lib.Trainer(config, resume_with)
  checkpointer = checkpoint_lib.Checkpointer(second.config)
  state, step = second.restore_or_init(checkpointer)
  assert step == SAVED_AT
  resumed = second.train(state, log=None)
  assert resumed.first_step == SAVED_AT
  np.testing.assert_allclose(resumed.losses,
                             uninterrupted_losses[SAVED_AT:], rtol=1e-5)


def test_keeps_only_the_newest_checkpoints(seeds, tmp_path):
  config = _config(seeds, tmp_path, checkpoint_period=1,
                   max_num_checkpoints_to_keep=2)
  trainer = trainer_lib.Trainer(config, OFF)
  checkpointer = checkpoint_lib.Checkpointer(trainer.config)
  trainer.train(trainer.init_state(), checkpointer=checkpointer, log=None)
  assert checkpointer.all_steps() == [TOTAL_STEPS - 1, TOTAL_STEPS]


def test_saves_on_the_period_and_the_last_step(seeds, tmp_path):
  config = _config(seeds, tmp_path, steps=5, checkpoint_period=2,
                   max_num_checkpoints_to_keep=10)
  trainer = trainer_lib.Trainer(config, OFF)
  checkpointer = checkpoint_lib.Checkpointer(trainer.config)
  trainer.train(trainer.init_state(), checkpointer=checkpointer, log=None)
  assert checkpointer.all_steps() == [2, 4, 5]
