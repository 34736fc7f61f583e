"""MaxText's Qwix quantization (`use_qwix_quantization=True`) through the
plugin's launcher against the plugin off, in float32: `fp8_gpu` served as
`quantization=fp8` is (every projection and its gradient's matmul in fp8,
the same losses, state and parameters); `fp8_full` and `int8` left to
MaxText (Qwix's own dot_general_qt) with only the unquantized logits
rewritten, so the first step's loss is the plugin-off one. Every other mode's
decision: test_qwix_modes.py."""
import numpy as np
import pytest

from maxtext_runs import cached_train

RING = ("--use_collective_matmul", "--collective_matmul_impl=ring")
STEPS = 3
CHECKPOINT_STEP = 2  # checkpoint_period=2.
# As test_fp8_training.py: the ring sums in another order, and an fp8
# rounding may flip where it does.
LOSS_RTOL = 1e-3
SCALE_RTOL = 1e-5
PARAM_ATOL = 1e-3  # Relative to each parameter's largest entry.
# Left modes: only the logits differ, by the ring's order of f32 sums.
LEFT_LOSS_RTOL = 1e-5

PROJECTIONS = ("mlp/wi_0", "mlp/wi_1", "mlp/wo", "attention/query",
               "attention/key", "attention/value", "attention/out")
REDUCE_SCATTERS = ("mlp/wo", "attention/out")
LOGITS = "decoder/logits_dense"


def _qwix(mode):
  return ("use_qwix_quantization=True", f"quantization={mode}")


def _runs(mode, steps):
  on = cached_train(f"llama2-7b-ts4_data2-f32-qwix-{mode}-ring", dtype="f32",
                    plugin=RING, steps=steps, extra=_qwix(mode))
  off = cached_train(f"llama2-7b-ts4_data2-f32-qwix-{mode}-off", dtype="f32",
                     plugin=(), steps=steps, extra=_qwix(mode))
  return on, off


def _lines(run, name):
  return [l for l in run.decision_lines() if l.startswith(name + " ")]


def test_fp8_gpu_serves_every_projection_and_its_gradient_matmul_in_fp8():
  on, _ = _runs("fp8_gpu", STEPS)
  for name in PROJECTIONS:
    forward, dgrad = _lines(on, name), _lines(on, name + "/dgrad")
    assert forward and dgrad, (name, on.decision_lines())
    for line in forward:
      assert "e4m3 x e4m3 -> f32: rewritten -> ring over" in line, line
      assert ("(matmul + reduce-scatter)" in line) == (
          name in REDUCE_SCATTERS), line
    for line in dgrad:
      assert "e5m2 x e4m3 -> f32: rewritten -> ring over" in line, line
  # No Qwix rule matches the logits: unquantized, as MaxText runs them.
  assert any("float32: rewritten" in l for l in _lines(on, LOGITS))


def test_fp8_gpu_trains_to_the_same_losses_state_and_parameters():
  on, off = _runs("fp8_gpu", STEPS)
  assert sorted(on.losses) == sorted(off.losses) == list(range(STEPS))
  for step, loss in off.losses.items():
    assert abs(on.losses[step] - loss) <= LOSS_RTOL * abs(loss), (
        on.losses, off.losses)
  on_state, off_state = (on.checkpoint(CHECKPOINT_STEP),
                         off.checkpoint(CHECKPOINT_STEP))
  # The same tree: a checkpoint of either restores in the other.
  assert on_state.keys() == off_state.keys()
  # MaxText's ToNNX of Flax's fp8 op on each DenseGeneral: three scales and
  # three amax histories (and its rngs).
  fp8_state = [k for k in off_state if "_qwix_fp8_gpu_dot_general0" in k
               and k.endswith(("_scale']", "_amax_history']"))]
  assert len(fp8_state) == 6 * len(PROJECTIONS), sorted(off_state)
  for key in fp8_state:
    if key.endswith("_scale']"):
      np.testing.assert_allclose(on_state[key], off_state[key],
                                 rtol=SCALE_RTOL, err_msg=key)
  for key in off_state:
    if key.startswith("['params']"):
      np.testing.assert_allclose(
          on_state[key], off_state[key], rtol=0,
          atol=PARAM_ATOL * np.max(np.abs(off_state[key])), err_msg=key)


@pytest.mark.parametrize("mode,dtype", [("fp8_full", "e4m3 x e4m3"),
                                        ("int8", "int8 x int8")])
def test_other_qwix_modes_are_left_to_maxtext_with_the_first_loss_unchanged(
    mode, dtype):
  on, off = _runs(mode, 1)
  for name in PROJECTIONS:
    lines = _lines(on, name)
    assert lines, (name, on.decision_lines())
    for line in lines:
      # Qwix's dtypes, never the float32 operands it would have bypassed.
      assert f" {dtype}: left to XLA (left to MaxText: quantized: Qwix " \
             f"quantization={mode} runs its own dot_general_qt" in line, line
  rewritten = [l for l in on.decision_lines() if ": rewritten" in l]
  assert rewritten and all(l.startswith(LOGITS + " ") for l in rewritten), (
      rewritten)
  assert abs(on.losses[0] - off.losses[0]) <= LEFT_LOSS_RTOL * abs(
      off.losses[0]), (on.losses, off.losses)
