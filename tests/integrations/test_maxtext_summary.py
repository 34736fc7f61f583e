"""The MaxText launcher's closing summary (summary.summary), without MaxText:
every projection accounted for, each reason said once, the settings, and
the tensor-sequence hint when nothing was rewritten (issue 30, item 2)."""
import collective_matmul as cm
from collective_matmul.integrations.maxtext import summary
from collective_matmul.record import Decision

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


def test_plugin_off_says_maxtext_ran_its_own_code():
  text = summary.summary([], cm.CollectiveMatmulConfig(enabled=False))
  assert "plugin off" in text and "--use_collective_matmul" in text
  assert "rewritten" not in text
