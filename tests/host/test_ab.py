"""The A/B harness trains both arms and writes its report."""
import json
import os

import numpy as np
import pytest

import collective_matmul as cm
from reference_host import ab as ab_lib
from reference_host import config as config_lib
from reference_host import trainer as trainer_lib

from host_test_utils import BASE_CONFIG, TEST_MODEL_ARGS

STEPS = 3


def test_ab_writes_report_json_and_png(tmp_path, rng):
  config = config_lib.load_config(
      [BASE_CONFIG, *TEST_MODEL_ARGS, "ici_tensor_sequence_parallelism=2",
       f"steps={STEPS}", f"init_weights_seed={int(rng.integers(1 << 30))}"])
  result = ab_lib.run_ab(config, cm.CollectiveMatmulConfig(impl="ring"),
                         log=None)
  paths = ab_lib.write_report(result, str(tmp_path), command="pytest")

  assert result.losses_match, result.loss_diffs
  np.testing.assert_allclose([r.loss for r in result.collective],
                             [r.loss for r in result.baseline], rtol=1e-4)
  assert "layers_0/mlp/wi_0" in result.rewritten_layers
  with open(paths["report"]) as f:
    report = f.read()
  assert "layers_0/mlp/wi_0" in report
  assert f"{result.step_time_ratio:.3f}" in report
  with open(paths["json"]) as f:
    raw = json.load(f)
  assert len(raw["baseline"]) == len(raw["collective"]) == STEPS
  assert raw["command"] == "pytest"
  assert os.path.getsize(paths["png"]) > 0


def test_baseline_arm_compiles_with_the_given_xla_options(rng):
  config = config_lib.load_config(
      [BASE_CONFIG, *TEST_MODEL_ARGS, "ici_tensor_sequence_parallelism=2",
       "steps=2", f"init_weights_seed={int(rng.integers(1 << 30))}"])
  windowed = dict(trainer_lib.WINDOWED_EINSUM)
  result = ab_lib.run_ab(config, cm.CollectiveMatmulConfig(impl="ring"),
                         log=None, baseline_compiler_options=windowed)
  assert result.baseline_compiler_options == windowed
  assert result.losses_match
  assert ab_lib.to_json(result, None)["baseline_compiler_options"] == windowed
  assert ab_lib.default_tag(result).endswith("-vs-xla-options")


def test_an_unknown_baseline_xla_option_fails_at_compile_naming_it(rng):
  config = config_lib.load_config(
      [BASE_CONFIG, *TEST_MODEL_ARGS, "ici_tensor_sequence_parallelism=2",
       "steps=1", f"init_weights_seed={int(rng.integers(1 << 30))}"])
  with pytest.raises(Exception, match="xla_no_such_option"):
    ab_lib.run_ab(config, cm.CollectiveMatmulConfig(impl="ring"), log=None,
                  baseline_compiler_options={"xla_no_such_option": 1})


@pytest.mark.parametrize("tolerance", [-1.0, -1e-12, float("nan"),
                                       float("inf"), float("-inf")])
def test_a_negative_or_non_finite_loss_tolerance_is_refused_before_training(
    tolerance, monkeypatch):
  # A negative tolerance failed bit-equal losses, a NaN every comparison.
  config = config_lib.load_config([BASE_CONFIG, *TEST_MODEL_ARGS, "steps=1"])
  monkeypatch.setattr(trainer_lib, "Trainer", None)  # Nothing may train.
  with pytest.raises(ValueError, match="not a finite number >= 0"):
    ab_lib.run_ab(config, cm.CollectiveMatmulConfig(impl="ring"), log=None,
                  relative_tolerance=tolerance)


def test_zero_and_positive_loss_tolerances_are_accepted(rng):
  for tolerance in (None, 0.0, *rng.uniform(0, 10, size=4)):
    ab_lib.check_relative_tolerance(tolerance)
