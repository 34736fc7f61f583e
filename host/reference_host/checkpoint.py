"""orbax checkpoints of the train state: periodic save, resume latest, keep N.

The train state holds plain arrays, so a checkpoint does not record whether it
was written with the collective matmul on or off; restoring into the same
abstract state (shapes, dtypes, shardings) works either way.
"""
from __future__ import annotations

from typing import Any

import orbax.checkpoint as ocp

from reference_host import config as config_lib


class Checkpointer:
  """Saves every `checkpoint_period` steps (and the last one), keeps the
  newest `max_num_checkpoints_to_keep`, restores the latest.

  Checkpoint step N holds the state after N training steps.
  """

  def __init__(self, config: config_lib.Config, directory: str | None = None):
    self.period = config.checkpoint_period
    # The period is applied in `save` rather than by orbax's save policy,
    # which would also save the first step it is shown.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.max_num_checkpoints_to_keep,
        enable_async_checkpointing=config.async_checkpointing, create=True)
    self.manager = ocp.CheckpointManager(
        directory or config.checkpoint_directory, options=options)

  @property
  def directory(self) -> str:
    return str(self.manager.directory)

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state: Any, *, last: bool = False) -> bool:
    """Saves `state` as `step` if the period says so or it is the `last`."""
    if not last and step % self.period:
      return False
    return self.manager.save(step, args=ocp.args.StandardSave(state),
                             force=True)

  def restore_latest(self, abstract_state: Any) -> tuple[int | None, Any]:
    """(step, state) of the newest checkpoint, or (None, None) if none.

    `abstract_state` is a tree of `jax.ShapeDtypeStruct` with shardings: the
    restored arrays are laid out as the current mesh wants them.
    """
    step = self.manager.latest_step()
    if step is None:
      return None, None
    return step, self.manager.restore(
        step, args=ocp.args.StandardRestore(abstract_state))

  def wait_until_finished(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
