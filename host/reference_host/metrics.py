"""Per-step metrics of a run, written where log tools look for them.

`metrics.jsonl` (one JSON object per step, MaxText's metric names) and, when
tensorboardX is installed, TensorBoard event files under `tensorboard/`,
both in the run's directory.
"""
from __future__ import annotations

import json
import os
from typing import Any


class MetricsWriter:
  """Appends each step's metrics to `<run_dir>/metrics.jsonl` and
  TensorBoard scalars to `<run_dir>/tensorboard/`."""

  def __init__(self, run_dir: str):
    os.makedirs(run_dir, exist_ok=True)
    self.jsonl_path = os.path.join(run_dir, "metrics.jsonl")
    self.tensorboard_dir = os.path.join(run_dir, "tensorboard")
    self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
    try:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    except ImportError:  # Optional: the JSONL file has everything.
      self._tensorboard = None
    else:
      self._tensorboard = SummaryWriter(self.tensorboard_dir)

  def write(self, record: Any) -> None:
    """Writes one `trainer.StepRecord`."""
    metrics = {
        "learning/loss": record.loss,
        "perf/step_time_seconds": record.step_time_s,
        "perf/per_device_tokens_per_sec": record.tokens_per_s_per_device,
        "perf/per_device_tflops_per_sec": record.tflops_per_device,
    }
    if record.mfu is not None:
      metrics["perf/mfu"] = record.mfu
    self._jsonl.write(json.dumps({"step": record.step, **metrics}) + "\n")
    self._jsonl.flush()
    if self._tensorboard is not None:
      for name, value in metrics.items():
        self._tensorboard.add_scalar(name, value, record.step)

  def close(self) -> None:
    self._jsonl.close()
    if self._tensorboard is not None:
      self._tensorboard.close()
