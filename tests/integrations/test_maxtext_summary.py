"""The MaxText launcher's closing summary (summary.summary), without MaxText:
every projection accounted for, each reason said once, the settings, and
the hint that fits the reasons when nothing was rewritten (issue 30, item 2;
issue 40, item 3)."""
import flax.linen as nn
import pytest

import collective_matmul as cm
from collective_matmul import patterns
from collective_matmul.integrations.maxtext import summary
from collective_matmul.record import Decision
import maxtext_rules as mt

CPU_REASON = "pallas unavailable: backend is 'cpu', the kernel needs a CUDA GPU"
ON = cm.CollectiveMatmulConfig(enabled=True, impl="auto")


def _rewritten(name, collective="all_gather"):
  return Decision(name=name, rewritten=True, impl="ring", reason=CPU_REASON,
                  lhs_shape=(8, 128, 256), rhs_shape=(256, 512),
                  dtype="bfloat16", axis="tensor_sequence",
                  collective=collective)


def _left(name, reason):
  return Decision(name=name, rewritten=False, impl=None, reason=reason,
                  lhs_shape=(8, 128, 256), rhs_shape=(256, 512),
                  dtype="bfloat16")


def test_every_projection_is_named_once_with_its_reason_said_once():
  records = [_rewritten("mlp/wi_0"), _rewritten("mlp/wi_1"),
             _rewritten("mlp/wo", "reduce_scatter"),
             _left("decoder/logits_dense", "excluded (--collective_matmul_exclude)"),
             # The same program traced again decides the same way.
             _rewritten("mlp/wi_0")]
  text = summary.summary(records, ON, "0.2.5", attention_on=False)
  assert text.splitlines()[0] == "collective matmul summary (MaxText 0.2.5):"
  assert "rewritten: 3 of 4 projections" in text
  assert ("-> ring over 'tensor_sequence': mlp/wi_0, mlp/wi_1 "
          f"({CPU_REASON})") in text
  assert ("-> ring over 'tensor_sequence' (matmul + reduce-scatter): mlp/wo"
          in text)
  assert text.count(CPU_REASON) == 2  # Once per kind, not per projection.
  assert ("left to MaxText / XLA: 1\n    decoder/logits_dense: excluded "
          "(--collective_matmul_exclude)") in text
  assert "plugin on, impl=auto, strict=False, fallback_impl=ring" in text
  assert "sharded GPU flash attention off" in text
  assert "ici_tensor_sequence_parallelism" not in text


def test_nothing_rewritten_says_to_use_tensor_sequence_parallelism():
  reason = "no mesh axis shards both an lhs row dimension and an rhs output dimension"
  text = summary.summary([_left("mlp/wi_0", reason)], ON)
  assert "rewritten: 0 of 1 projections" in text
  assert f"mlp/wi_0: {reason}" in text
  assert summary.NOTHING_REWRITTEN_HINT in text
  assert "set ici_tensor_sequence_parallelism > 1" in text


def test_plain_tensor_parallelism_as_maxtext_runs_it_gets_the_hint():
  # The reasons a MaxText run with ici_tensor_parallelism=4, data 2 records
  # (activations sharded on their features over 'tensor'), as README quotes.
  records = [
      _left("mlp/wi_0", "no mesh axis shards the contracting dimension of "
            "both lhs and rhs"),
      _left("mlp/wo", "the contraction is sharded over ['tensor'] but the "
            "result is asked for on its columns: out_sharding (('data',), (), "
            "('tensor',))")]
  assert summary.nothing_rewritten_hint(records) == (
      summary.NOTHING_REWRITTEN_HINT)
  assert "set ici_tensor_sequence_parallelism > 1" in summary.summary(
      records, ON)


def test_plugin_off_says_maxtext_ran_its_own_code():
  text = summary.summary([], cm.CollectiveMatmulConfig(enabled=False))
  assert "plugin off" in text and "--use_collective_matmul" in text
  assert "rewritten" not in text


def _matcher_reasons(**mesh):
  """What the matcher says of MaxText's wi_0 and wo on this mesh (sizes of
  MaxText's mesh axes), as the adapter records them."""
  sizes = dict(zip(mt.MESH_AXES, mt.mesh_shape(**mesh)))

  def resolve(axes):
    with nn.logical_axis_rules(mt.LOGICAL_AXIS_RULES):
      spec = patterns.normalize_spec(nn.logical_to_mesh_axes(axes),
                                     len(axes))
    return patterns.drop_size_one_axes(spec, sizes)

  dn = (((2,), (0,)), ((), ()))
  wi_0 = patterns.match_all_gather_matmul(
      (8, 16, 32), (32, 64), dn, resolve(mt.RESIDUAL),
      resolve(("embed", "mlp")), sizes)
  wo = patterns.match_matmul_reduce_scatter(
      (8, 16, 64), (64, 32), dn, resolve(mt.MLP_HIDDEN),
      resolve(("mlp", "embed")), sizes, resolve(mt.RESIDUAL))
  assert isinstance(wi_0, patterns.NoMatch), wi_0
  assert isinstance(wo, patterns.NoMatch), wo
  return [_left("mlp/wi_0", wi_0.reason), _left("mlp/wo", wo.reason)]


@pytest.mark.parametrize("mesh,hint", [
    (dict(data=2, tensor=4), summary.NOTHING_REWRITTEN_HINT),
    (dict(tensor=2, tensor_sequence=4), summary.TENSOR_AXIS_HINT),
    (dict(tensor=2, tensor_sequence=2, data=2), summary.TENSOR_AXIS_HINT),
    (dict(context=2, tensor_sequence=4), summary.MINOR_AXIS_HINT),
])
def test_nothing_rewritten_gives_the_hint_of_the_mesh(mesh, hint):
  text = summary.summary(_matcher_reasons(**mesh), ON)
  assert "rewritten: 0 of 2 projections" in text
  assert text.endswith(f"  {hint}")
  others = {summary.NOTHING_REWRITTEN_HINT, summary.TENSOR_AXIS_HINT,
            summary.MINOR_AXIS_HINT} - {hint}
  assert not any(other in text for other in others)


def test_a_tensor_sequence_mesh_is_not_told_to_set_tensor_sequence():
  for mesh in (dict(tensor=2, tensor_sequence=4),
               dict(context=2, tensor_sequence=4)):
    text = summary.summary(_matcher_reasons(**mesh), ON)
    assert "set ici_tensor_sequence_parallelism > 1" not in text


def test_nothing_rewritten_for_reasons_no_mesh_explains_gives_no_hint():
  records = [_left(name, "left to MaxText: quantized (quant config: "
                   "AqtDotGeneral)") for name in ("mlp/wi_0", "mlp/wo")]
  text = summary.summary(records, ON)
  assert "rewritten: 0 of 2 projections" in text
  assert summary.nothing_rewritten_hint(records) is None
  assert "nothing was rewritten" not in text


def test_no_hint_when_something_was_rewritten():
  records = [_rewritten("mlp/wi_0"), *_matcher_reasons(data=2, tensor=4)]
  assert summary.nothing_rewritten_hint(records) is None


def _fp8(name, collective="all_gather", dtype="e4m3 x e4m3 -> bf16"):
  return Decision(name=name, rewritten=True, impl="ring", reason="",
                  lhs_shape=(8, 128, 256), rhs_shape=(256, 512), dtype=dtype,
                  axis="tensor_sequence", collective=collective)


def test_gradient_matmuls_are_counted_apart_from_the_projections():
  records = [_fp8("mlp/wi_0"), _fp8("mlp/wo", "reduce_scatter"),
             _fp8("mlp/wi_0/dgrad", "reduce_scatter", "e5m2 x e4m3 -> bf16"),
             _fp8("mlp/wo/dgrad", dtype="e5m2 x e4m3 -> bf16")]
  text = summary.summary(records, ON)
  assert "rewritten: 2 of 2 projections" in text
  assert "and 2 of 2 gradient matmuls (name/dgrad: " in text
  projections, gradients = text.split("gradient matmuls")
  assert "/dgrad" not in projections.split("\n", 1)[1]
  assert "mlp/wi_0/dgrad" in gradients and "mlp/wo/dgrad" in gradients


def test_fp8_siblings_say_why_they_are_not_grouped_with_the_bytes():
  records = [_fp8("attention/query"), _fp8("attention/key"),
             _fp8("attention/value"), _fp8("attention/out", "reduce_scatter")]
  text = summary.summary(records, ON)
  line = next(l for l in text.splitlines() if "fp8 siblings" in l)
  # 8 x 128 x 256 = 256 Ki elements: one e4m3 byte each, two in bf16.
  assert ("attention/query, attention/key, attention/value each all-gather "
          "their own e4m3 activation 8x128x256, 3 x 256 KiB = 768 KiB") in line
  assert "one grouped gather would send 256 KiB of e4m3" in line
  assert "512 KiB of the bf16 activation" in line
  assert "attention/out" not in line


def test_format_decisions_explains_a_repeated_decision():
  once = cm.format_decisions([_fp8("mlp/wi_0")])
  assert "[x" not in once
  twice = cm.format_decisions([_fp8("mlp/wi_0"), _fp8("mlp/wi_0")])
  assert "  [x2]" in twice
  assert twice.splitlines()[-1].startswith("  [xN]: the same decision made")
