"""MaxText's Qwix quantization (`use_qwix_quantization=True`) through the
plugin's launcher against the plugin off, in float32: `fp8_gpu` served as
`quantization=fp8` is (every projection and its gradient's matmul in fp8,
the same losses, state and parameters); Qwix's rowwise fp8 modes
(`fp8_full`, `fp8`, `fp8_e4m3`, `fp8_e5m2`: its own dot_general_qt) served
with their per-row and per-column scales, each trained one step on and
off: every projection and its gradient's matmul recorded rewritten in the
mode's dtypes and "rowwise", the same first loss, and a per-tensor scale
planted in their place caught; the other modes (`int8`, `int4`, `fp4`:
Qwix's dot_general_qt on integer or fp4 values; `fp8_nanoo`: Flax's
NANOOFp8DotGeneralOp) left to MaxText, each trained one step on and off:
every projection recorded with the mode's dtypes, only the unquantized
logits rewritten, so the first step's loss is the plugin-off one. Each
mode's decision in process: test_qwix_modes.py."""
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


def _one_step(mode):
  """`_runs` of one step without checkpoints (for tests that read only the
  record and the first loss)."""
  return _runs(mode, 1, checkpoints=False)


def _first_losses_agree(on, off, rtol=LEFT_LOSS_RTOL):
  return abs(on.losses[0] - off.losses[0]) <= rtol * abs(off.losses[0])


def _lines(run, name):
  return [l for l in run.decision_lines() if l.startswith(name + " ")]


def _each_projection(run, suffix=""):
  """(name, its record lines) of every projection (`suffix`: of its
  "/dgrad"), each recorded."""
  for name in PROJECTIONS:
    lines = _lines(run, name + suffix)
    assert lines, (name + suffix, run.decision_lines())
    yield name, lines


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


# Qwix's rowwise fp8 modes: (forward, dgrad) operand dtypes, as recorded.
# fp8 and fp8_e4m3 are one Qwix rule (their programs are the same, so the
# second's compile comes from the session's cache).
ROWWISE_MODES = {
    "fp8_full": ("e4m3 x e4m3", "e5m2 x e4m3"),
    "fp8": ("e4m3 x e4m3", "e4m3 x e4m3"),
    "fp8_e4m3": ("e4m3 x e4m3", "e4m3 x e4m3"),
    "fp8_e5m2": ("e5m2 x e5m2", "e5m2 x e5m2"),
}
# First losses, relative. The ring sums the reduce-scatter projections' f32
# partial products in another order than XLA; the next layer's activations
# then differ at f32 roundoff, and an e5m2 rounding (2 mantissa bits) that
# flips moves a value by up to a quarter: fp8_e5m2's first loss moved by
# 2.0e-5 (through `baseline`, XLA's order, it is bit-identical: the test
# below). With e4m3's 3 bits the first losses differ by 1.3e-7.
ROWWISE_LOSS_RTOL = {"fp8_e5m2": 1e-4}


@pytest.mark.parametrize("mode", ROWWISE_MODES)
def test_rowwise_modes_serve_every_projection_with_maxtext_s_first_loss(
    mode):
  on, off = _one_step(mode)
  forward_dtype, dgrad_dtype = ROWWISE_MODES[mode]
  for name, lines in _each_projection(on):
    served = f" {forward_dtype} -> f32 rowwise: rewritten -> ring over"
    assert all(served in line and ("(matmul + reduce-scatter)" in line) == (
        name in REDUCE_SCATTERS) for line in lines), lines
  for name, lines in _each_projection(on, "/dgrad"):
    assert all(f" {dgrad_dtype} -> f32 rowwise: rewritten -> ring over" in
               line for line in lines), lines
  assert _first_losses_agree(on, off, ROWWISE_LOSS_RTOL.get(
      mode, LEFT_LOSS_RTOL)), (on.losses, off.losses)


def test_fp8_e5m2_through_xla_s_collectives_has_maxtext_s_first_loss():
  """Where the sums run in XLA's order (`baseline`: its collectives, the
  row and column scales in the f32 accumulation), fp8_e5m2's first loss is
  the plugin-off one to 1e-5: the ring's wider tolerance is its order."""
  _, off = _one_step("fp8_e5m2")
  [on] = cached_train_together((
      "llama2-7b-ts4_data2-f32-qwix-fp8_e5m2-baseline", dict(
          plugin=("--use_collective_matmul",
                  "--collective_matmul_impl=baseline"), dtype="f32",
          steps=1, extra=_qwix("fp8_e5m2"), checkpoints=False)))
  lines = [l for name in PROJECTIONS for l in _lines(on, name)]
  assert lines and all(" rowwise: rewritten -> baseline" in l
                       for l in lines), lines
  assert _first_losses_agree(on, off), (on.losses, off.losses)


def test_a_per_tensor_scale_planted_in_place_of_the_rowwise_ones_is_caught():
  """The positive control of the comparison above: the same run with each
  product scaled by its scales' largest entry (one per tensor) is as
  served by the record, and its first loss is not MaxText's."""
  _, off = _one_step("fp8_full")
  [planted] = cached_train_together((
      "llama2-7b-ts4_data2-f32-qwix-fp8_full-per-tensor", dict(
          plugin=RING, dtype="f32", steps=1, extra=_qwix("fp8_full"),
          checkpoints=False, launcher="launch_with_per_tensor_scales.py")))
  assert any(" rowwise: rewritten" in l for l in planted.decision_lines())
  assert not _first_losses_agree(planted, off), (planted.losses, off.losses)


# What every projection's record shows in each mode left to MaxText (each
# found by training it): Qwix's dtypes, and how Qwix runs it after
# "quantization=<mode>".
_QT = " runs its own dot_general_qt"
LEFT_MODES = {
    "int8": ("int8 x int8", _QT),
    "int4": ("int4 x int4", _QT),
    "fp4": ("float4_e2m1fn x float4_e2m1fn", _QT),
    "fp8_nanoo": ("e4m3fnuz x e4m3fnuz", ": Flax's NANOOFp8DotGeneralOp"),
}


def test_every_qwix_mode_maxtext_accepts_is_trained_on_and_off():
  assert sorted(["fp8_gpu", *ROWWISE_MODES, *LEFT_MODES]) == QWIX_MODES


@pytest.mark.parametrize("mode", LEFT_MODES)
def test_other_qwix_modes_are_left_to_maxtext_with_the_first_loss_unchanged(
    mode):
  dtype, how = LEFT_MODES[mode]
  on, off = _one_step(mode)
  for _, lines in _each_projection(on):
    for line in lines:
      # Qwix's dtypes, never the float32 operands it would have bypassed.
      assert f" {dtype}: left to XLA (left to MaxText: quantized: Qwix " \
             f"quantization={mode}{how}" in line, line
  # No projection rewritten (in float32 or any dtype): only the logits, which
  # no Qwix rule matches.
  rewritten = [l for l in on.decision_lines() if ": rewritten" in l]
  assert rewritten and all(l.startswith(LOGITS + " ") for l in rewritten), (
      rewritten)
  assert _first_losses_agree(on, off), (on.losses, off.losses)
