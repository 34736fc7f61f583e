"""The projections the adapter names and leaves, and the owners it names
them by, under MaxText's own logical axis rules (its base.yml): the
decisions on stand-in modules, the rules read from the installed MaxText.
Trained end to end: test_coverage.py (qwen3_next) and tools/
maxtext_coverage.py."""
import os
import types

import flax.linen as nn
import jax.numpy as jnp
import pytest
import yaml

from collective_matmul.integrations.maxtext import dense as dense_lib
from collective_matmul.integrations.maxtext import frames as frames_lib
from collective_matmul.integrations.maxtext import projections

X3 = jnp.zeros((2, 8, 16))
W = jnp.zeros((16, 32))


def _base_rules():
  import maxtext  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.dirname(maxtext.__file__), "configs",
                      "base.yml")
  with open(path) as f:
    rules = yaml.safe_load(f)["logical_axis_rules"]
  return tuple((logical, tuple(axes) if isinstance(axes, list) else axes)
               for logical, axes in rules)


def _decide(owners, attr, kernel_axes, inputs=X3):
  """`_not_served_reason` for `attr`, a DenseGeneral of the innermost of
  `owners` ((kind, label, model_mode) from the outermost in)."""
  dense = types.SimpleNamespace(kernel_axes=kernel_axes,
                                shard_mode="ShardMode.AUTO")
  module = types.SimpleNamespace(**{attr: dense})
  frames = []
  for kind, label, mode in reversed(owners):
    frames.insert(0, frames_lib.Frame(kind, module, mode, label=label))
    module = types.SimpleNamespace(inner=module)
  with nn.logical_axis_rules(_base_rules()):
    return dense_lib.not_served_reason(
        frames + [frames_lib.Frame("dense", dense)], inputs, W, None, None,
        False)


@pytest.mark.parametrize("key", sorted(projections.RULES_UNSHARDED))
def test_maxtexts_rules_leave_these_weights_unsharded_and_the_reason_says_so(
    key):
  owner, kernel_axes = key
  what, dim, role = projections.RULES_UNSHARDED[key]
  with nn.logical_axis_rules(_base_rules()):
    spec = tuple(nn.logical_to_mesh_axes(kernel_axes))
  # MaxText's own rules: the dimension has no mesh axis, the other one
  # holds 'fsdp_transpose'.
  assert spec[dim] is None and "fsdp_transpose" in spec[1 - dim], spec
  reason, projection, name = _decide([(owner, "", "train")], "proj",
                                     kernel_axes)
  assert projection is None and name == f"{owner}/proj"
  assert reason.startswith(what), reason
  assert (f"give its kernel's {role} features ('{kernel_axes[dim]}') no "
          "mesh axis (its rule also lists 'fsdp_transpose', which "
          "'embed_attn' took first") in reason, reason
  collective = "all-gather" if role == "output" else "reduce-scatter"
  assert reason.endswith(f"no {collective} to overlap"), reason


def test_with_rules_that_shard_them_the_reason_says_they_are_untested():
  # 'gdn_head' first: Flax gives it its mesh axes before 'embed_attn'.
  rules = (("gdn_head", ("tensor", "tensor_sequence")),) + _base_rules()
  with nn.logical_axis_rules(rules):
    reason = dense_lib.rules_unsharded_reason(
        ("embed_attn", "gdn_head"), "it", 1, "output")
  assert reason.startswith("it: not served (tested only with MaxText's "
                           "default rules"), reason
  assert "('tensor', 'tensor_sequence')" in reason, reason


def test_qwen3_next_moe_blocks_projections_are_named_under_moe():
  # Qwen3NextSparseMoeBlock ("shared_moe", named "moe"): its shared expert,
  # an MlpBlock, is served; its gate of one output feature is left.
  reason, projection, name = _decide(
      [("shared_moe", "moe", None), ("mlp", "", "train")], "wi_0",
      ("embed", "mlp"))
  assert reason is None and projection.collective == "all_gather"
  assert name == "moe/inner/wi_0"
  reason, projection, name = _decide([("shared_moe", "moe", None)],
                                     "shared_expert_gate", ("embed", None))
  assert projection is None and name == "moe/shared_expert_gate"
  assert reason.startswith("the shared expert's gate: its kernel ('embed', "
                           "None) has one output feature"), reason


def test_qwen3_customs_up_projection_is_left_with_its_reason():
  reason, projection, name = _decide(
      [("qwen3_custom_layer", "layer", "train")], "layer_up_projection",
      ("mlp", "embed"))
  assert projection is None and name == "layer/layer_up_projection"
  assert reason.startswith("qwen3-custom's up projection after the "
                           "experts"), reason


def test_gemma4_smalls_per_layer_embedder_is_served_in_training_only():
  reason, projection, name = _decide([("per_layer_embedder", "", "train")],
                                     "per_layer_model_projection",
                                     ("embed", "mlp"))
  assert reason is None and projection.collective == "all_gather"
  assert projection.activation_axes == projections.RESIDUAL
  assert name == "per_layer_embedder/per_layer_model_projection"
  reason, projection, _ = _decide([("per_layer_embedder", "", "prefill")],
                                  "per_layer_model_projection",
                                  ("embed", "mlp"))
  assert projection is None and reason.startswith("model_mode='prefill'")
