"""Projections beyond MlpBlock's, Attention's and the dense logits, on real
MaxText: each served one trains to plugin-off's losses with its gradients
(f32). What is left, with reasons: test_coverage.py."""
import numpy as np

from maxtext_runs import cached_train_together

RING = ("--use_collective_matmul", "--collective_matmul_impl=ring")
STEPS = 3
TIED = ("logits_via_embedding=True",)


def _summary(run):
  return run.stdout[run.stdout.index("collective matmul summary"):]


def _first_moments(run):
  """Adam's first moment after step 0 of every parameter: (1 - b1) times
  its gradient (MaxText's first checkpoint is written after step 0)."""
  moments = {k: v for k, v in run.checkpoint(0).items()
             if "['mu']" in k and "['params']" in k}
  assert moments, sorted(run.checkpoint(0))[:20]
  return moments


def _assert_rewritten(run, name, how):
  """Every decision line of projection `name` says it was rewritten to the
  ring over `how` (the axis, and "(matmul + reduce-scatter)" exactly for a
  reduce-scatter)."""
  lines = {l for l in run.decision_lines() if l.startswith(name + " ")}
  assert lines, (name, run.stdout)
  for line in lines:
    assert f"rewritten -> ring over {how}" in line, line
    assert ("reduce-scatter" in how) == ("reduce-scatter" in line), line


def test_tied_embedding_logits_are_served_with_the_same_losses_and_gradients():
  on, off = cached_train_together(
      ("llama2-7b-tied-f32-ring",
       dict(dtype="f32", plugin=RING, steps=STEPS, extra=TIED)),
      ("llama2-7b-tied-f32-off",
       dict(dtype="f32", plugin=(), steps=STEPS, extra=TIED)))
  (line,) = [l for l in on.decision_lines()
             if l.startswith("decoder/logits_via_embedding ")]
  assert "rewritten -> ring over 'tensor_sequence'" in line, line
  assert "decoder/logits_via_embedding" in _summary(on)
  assert "logits_dense" not in on.stdout
  assert any("token_embedder" in k for k in _first_moments(on))
  # MaxText casts the table to bf16 for the logits (attend_on_embedding), so
  # their part of its gradient is rounded to bf16: summed in another order
  # it may round one bf16 step (2**-8 relative) apart.
  assert_same_training(on, off, bf16_gradients=("token_embedder",))


def assert_same_training(on, off, bf16_gradients=(), rounding_only=()):
  """Equal f32 losses, and every parameter's gradient of step 0 (those
  whose key names one of `bf16_gradients` to bf16's precision; those that
  name one of `rounding_only` not: their sums cancel to rounding level, so
  any other partitioning changes them as much)."""
  assert sorted(on.losses) == sorted(off.losses) == list(range(STEPS))
  for step in on.losses:
    assert abs(on.losses[step] - off.losses[step]) <= 1e-5 * off.losses[step]
  a, b = _first_moments(on), _first_moments(off)
  assert a.keys() == b.keys()
  checked = [k for k in a if not any(name in k for name in rounding_only)]
  assert len(checked) > len(a) // 2, sorted(a)
  for key in checked:
    scale = np.abs(b[key]).max()
    rtol = 2 ** -7 if any(name in key for name in bf16_gradients) else 1e-4
    np.testing.assert_allclose(a[key], b[key], rtol=rtol,
                               atol=rtol * 0.1 * scale, err_msg=key)



def test_mla_out_projection_and_shared_experts_are_served_the_same():
  # deepseek's multi-head latent attention: its out projection is
  # Attention's; its low-rank query and key/value projections are left.
  # Its MoE layer (RoutedAndSharedMoE): the shared experts, an MlpBlock of
  # the dense pattern, are served; the routed experts and the gate are left.
  on, off = cached_train_together(
      ("deepseek3-tiny-f32-ring", dict(model="deepseek3-tiny", dtype="f32",
                                       plugin=RING, steps=STEPS)),
      ("deepseek3-tiny-f32-off", dict(model="deepseek3-tiny", dtype="f32",
                                      plugin=(), steps=STEPS)))
  for name, how in (
      ("attention/out", "'tensor_sequence' (matmul + reduce-scatter)"),
      ("moe/shared_experts/wi_0", "'tensor_sequence'"),
      ("moe/shared_experts/wi_1", "'tensor_sequence'"),
      ("moe/shared_experts/wo", "'tensor_sequence' (matmul + reduce-scatter)"),
      # The dense first layer's MlpBlock, named apart from them.
      ("mlp/wi_0", "'tensor_sequence'")):
    _assert_rewritten(on, name, how)
  summary = _summary(on)
  left = summary[summary.index("left to MaxText / XLA"):]
  for name in ("attention/wq_a", "attention/wkv_b", "moe/gate", "moe/wo"):
    assert name in left, (name, summary)
  assert "moe/wo: left to MaxText: routed experts" in left, left
  assert "shared_experts" not in left, left
  # Their gradients are among those checked (MaxText's parameter names).
  assert any("shared_experts" in k for k in _first_moments(on))
  assert_same_training(on, off)


def test_gpt3_out_projection_is_served_with_the_same_losses_and_gradients():
  # gpt3's own attention class: its out projection is Attention's; its
  # fused query/key/value projection reads an input already gathered.
  on, off = cached_train_together(
      ("gpt3-52k-f32-ring", dict(model="gpt3-52k", dtype="f32", plugin=RING,
                                 steps=STEPS)),
      ("gpt3-52k-f32-off", dict(model="gpt3-52k", dtype="f32", plugin=(),
                                steps=STEPS)))
  (line,) = {l for l in on.decision_lines()
             if l.startswith("attention/out ")}
  assert "rewritten -> ring over 'tensor_sequence' (matmul + " in line, line
  assert "attention/qkv_proj: left to MaxText: gpt3's fused" in (
      _summary(on))
  assert_same_training(on, off, bf16_gradients=("token_embedder",))


def test_gemma4_per_layer_input_projections_are_served_with_the_same_losses():
  on, off = cached_train_together(
      ("gemma4-e2b-f32-ring", dict(model="gemma4-e2b", dtype="f32",
                                   plugin=RING, steps=STEPS)),
      ("gemma4-e2b-f32-off", dict(model="gemma4-e2b", dtype="f32",
                                  plugin=(), steps=STEPS)))
  for name, how in (
      ("layer/per_layer_input_gate", "'tensor_sequence'"),
      ("layer/per_layer_projection",
       "'tensor_sequence' (matmul + reduce-scatter)"),
      # Outside the layers: the embeddings into every layer's input.
      ("per_layer_embedder/per_layer_model_projection", "'tensor_sequence'"),
      # The second layer shares the first's key/value, and the first uses
      # those it computed as their donor (compute_shared_kv): no key/value
      # projection runs in Attention.__call__ here.
      ("attention/key", "'tensor_sequence'"),
      ("attention/value", "'tensor_sequence'")):
    _assert_rewritten(on, name, how)
  assert "left to MaxText / XLA: 0 (none)" in _summary(on), _summary(on)
  # The query/key norms' scales and the layer scalars of this tiny gemma4
  # get gradients that cancel to rounding: stock MaxText on another mesh
  # (ts2_data2_fsdp2) differs from itself on ts4_data2 as much in them.
  assert_same_training(on, off, bf16_gradients=("token_embedder",),
                       rounding_only=("query_norm", "key_norm",
                                      "layer_scalar"))
