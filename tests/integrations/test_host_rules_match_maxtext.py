"""The reference host shards like MaxText (issue 30, item 3): plain tensor
parallelism shards the activations between blocks on their features, only
tensor-sequence parallelism on their sequence; so on the host, as in
MaxText, plain tensor parallelism rewrites nothing, for the reasons README
quotes."""
import os
import re

import collective_matmul as cm
import maxtext_rules as mt
from collective_matmul.integrations.maxtext import projections
from reference_host import config as config_lib
from reference_host import model as model_lib
from reference_host import trainer as trainer_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
BASE_CONFIG = os.path.join(REPO_ROOT, "model_configs", "base.yml")
TENSOR_AXES = ("tensor", "tensor_sequence")


def _first_rule(rules, logical):
  for name, axes in rules:
    if name == logical:
      axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
      return tuple(a for a in axes if a in TENSOR_AXES)
  return ()


def test_block_activations_take_maxtexts_tensor_axes_dim_by_dim():
  host_rules = config_lib.load_config(
      [BASE_CONFIG, "model_name=tiny"]).logical_axis_rules
  host = [_first_rule(host_rules, a) for a in model_lib.BLOCK_ACTIVATION_AXES]
  maxtext = [_first_rule(mt.LOGICAL_AXIS_RULES, a)
             for a in projections.RESIDUAL]
  assert host == maxtext == [(), ("tensor_sequence",), ("tensor",)]


def _readme_quoted_reasons():
  with open(os.path.join(REPO_ROOT, "README.md")) as f:
    text = f.read()
  paragraph = re.search(r"Plain tensor parallelism.*?\n\n", text, re.S)
  assert paragraph, "README has no paragraph on plain tensor parallelism"
  quoted = re.findall(r'"([^"]+)"', " ".join(paragraph.group(0).split()))
  assert quoted, paragraph.group(0)
  return quoted


def test_plain_tensor_parallelism_rewrites_nothing_for_the_reasons_readme_quotes():
  config = config_lib.load_config(
      [BASE_CONFIG, "model_name=tiny", "base_num_decoder_layers=1",
       "ici_tensor_parallelism=4"], num_devices=8)
  trainer = trainer_lib.Trainer(
      config, cm.CollectiveMatmulConfig(enabled=True, impl="ring"))
  trainer.compile()
  records = trainer.decisions
  assert records and not any(d.rewritten for d in records)
  reasons = {d.reason for d in records}
  for quote in _readme_quoted_reasons():
    assert any(quote in reason for reason in reasons), (quote, reasons)
