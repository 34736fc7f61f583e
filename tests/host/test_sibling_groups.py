"""The unfused q/k/v (GQA: tiny has 8 query and 4 kv heads) and wi_0/wi_1
run as one collective matmul per group (cm.grouped_logical_dot_general),
with the plugin-off losses."""
import numpy as np
import pytest

import collective_matmul as cm
from reference_host import ab as ab_lib
from reference_host import config as config_lib

from host_test_utils import BASE_CONFIG, TEST_MODEL_ARGS

GROUPS = {"self_attention": ("query", "key", "value"),
          "mlp": ("wi_0", "wi_1")}


@pytest.mark.parametrize("group_siblings", [True, False],
                         ids=["grouped", "ungrouped"])
def test_siblings_train_to_the_plugin_off_losses(rng, group_siblings):
  config = config_lib.load_config(
      [BASE_CONFIG, *TEST_MODEL_ARGS, "ici_tensor_sequence_parallelism=4",
       "steps=2",
       f"init_weights_seed={int(rng.integers(1 << 30))}"])
  result = ab_lib.run_ab(
      config, cm.CollectiveMatmulConfig(impl="ring",
                                        group_siblings=group_siblings),
      log=None)
  assert result.losses_match, result.loss_diffs
  np.testing.assert_allclose([r.loss for r in result.collective],
                             [r.loss for r in result.baseline], rtol=1e-4)
  by_name = {d.name: d for d in result.decisions}
  for block, members in GROUPS.items():
    names = tuple(f"layers_0/{block}/{m}" for m in members)
    for name in names:
      decision = by_name[name]
      assert decision.rewritten and decision.axis == "tensor_sequence"
      if group_siblings:
        assert decision.group == names, decision
      else:
        assert not decision.group and "switched off" in (
            decision.group_reason), decision
