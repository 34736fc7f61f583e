"""MaxText's Qwix quantization (`use_qwix_quantization=True`) through the
plugin's launcher against the plugin off, in float32: `fp8_gpu` served as
`quantization=fp8` is (every projection and its gradient's matmul in fp8,
the same losses, state and parameters); every other mode MaxText 0.2.5
accepts (`fp8_full`, `fp8`, `fp8_e4m3`, `fp8_e5m2`, `int8`, `int4`, `fp4`:
Qwix's own dot_general_qt; `fp8_nanoo`: Flax's NANOOFp8DotGeneralOp) left
to MaxText, each trained one step on and off: every projection recorded
with the mode's dtypes, only the unquantized logits rewritten, so the first
step's loss is the plugin-off one. Each mode's decision in process:
test_qwix_modes.py."""
import numpy as np
import pytest

from maxtext_runs import cached_train_together
from test_qwix_modes import QWIX_MODES

RING = ("--use_collective_matmul", "--collective_matmul_impl=ring")
STEPS = 3
CHECKPOINT_STEP = 2  # checkpoint_period=2.
# As test_fp8_training.py: the ring sums in another order, and an fp8
# rounding may flip where it does.
LOSS_RTOL = 1e-3
SCALE_RTOL = 1e-5
PARAM_ATOL = 1e-3  # Relative to each parameter's largest entry.
# Left modes: only the logits differ, by the ring's order of f32 sums (at
# most 1.3e-7 relative, int4's). Each mode's first loss is >= 4.8e-5
# relative (int8's) from the unquantized one, so projections run without the
# mode's quantization fail it.
LEFT_LOSS_RTOL = 1e-5

PROJECTIONS = ("mlp/wi_0", "mlp/wi_1", "mlp/wo", "attention/query",
               "attention/key", "attention/value", "attention/out")
REDUCE_SCATTERS = ("mlp/wo", "attention/out")
LOGITS = "decoder/logits_dense"


def _qwix(mode):
  return ("use_qwix_quantization=True", f"quantization={mode}")


def _runs(mode, steps, checkpoints=True):
  """The plugin on (the ring) and off, trained at once."""
  common = dict(dtype="f32", steps=steps, extra=_qwix(mode),
                checkpoints=checkpoints)
  on, off = cached_train_together(
      (f"llama2-7b-ts4_data2-f32-qwix-{mode}-ring", dict(plugin=RING,
                                                        **common)),
      (f"llama2-7b-ts4_data2-f32-qwix-{mode}-off", dict(plugin=(),
                                                       **common)))
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


# What every projection's record shows in each mode left to MaxText (each
# found by training it): Qwix's dtypes, and how Qwix runs it after
# "quantization=<mode>". fp8 and fp8_e4m3 are one Qwix rule (their programs
# are the same, so the second's compile comes from the session's cache).
_QT = " runs its own dot_general_qt"
LEFT_MODES = {
    "fp8_full": ("e4m3 x e4m3", _QT),
    "fp8": ("e4m3 x e4m3", _QT),
    "fp8_e4m3": ("e4m3 x e4m3", _QT),
    "fp8_e5m2": ("e5m2 x e5m2", _QT),
    "int8": ("int8 x int8", _QT),
    "int4": ("int4 x int4", _QT),
    "fp4": ("float4_e2m1fn x float4_e2m1fn", _QT),
    "fp8_nanoo": ("e4m3fnuz x e4m3fnuz", ": Flax's NANOOFp8DotGeneralOp"),
}


def test_every_qwix_mode_maxtext_accepts_is_trained_on_and_off():
  assert sorted(["fp8_gpu", *LEFT_MODES]) == QWIX_MODES


@pytest.mark.parametrize("mode", LEFT_MODES)
def test_other_qwix_modes_are_left_to_maxtext_with_the_first_loss_unchanged(
    mode):
  dtype, how = LEFT_MODES[mode]
  # One step, no checkpoints: only the record and the first loss are read.
  on, off = _runs(mode, 1, checkpoints=False)
  for name in PROJECTIONS:
    lines = _lines(on, name)
    assert lines, (name, on.decision_lines())
    for line in lines:
      # Qwix's dtypes, never the float32 operands it would have bypassed.
      assert f" {dtype}: left to XLA (left to MaxText: quantized: Qwix " \
             f"quantization={mode}{how}" in line, line
  # No projection rewritten (in float32 or any dtype): only the logits, which
  # no Qwix rule matches.
  rewritten = [l for l in on.decision_lines() if ": rewritten" in l]
  assert rewritten and all(l.startswith(LOGITS + " ") for l in rewritten), (
      rewritten)
  assert abs(on.losses[0] - off.losses[0]) <= LEFT_LOSS_RTOL * abs(
      off.losses[0]), (on.losses, off.losses)
