"""MaxText's `quantization=fp8` through the plugin's launcher against the
plugin off: every fp8 projection and its gradient's matmul served, the same
parameter tree, losses and parameters within fp8 tolerance, and the same
fp8 scales. In float32 (`matmul_precision=highest`), so that what differs is
only where the ring sums in another order and an fp8 rounding flips."""
import numpy as np

from maxtext_runs import cached_train_together

FP8 = ("quantization=fp8",)
RING = ("--use_collective_matmul", "--collective_matmul_impl=ring")
STEPS = 3
CHECKPOINT_STEP = 2  # checkpoint_period=2.
LOSS_RTOL = 1e-3
# The scales each step used: float arithmetic on the same amax histories.
SCALE_RTOL = 1e-5
# The amaxes themselves: of arrays that went through e5m2 roundings (the
# cotangents) that may flip where the sums' order differs.
AMAX_RTOL = 2.0**-3
PARAM_ATOL = 1e-3  # Relative to each parameter's largest entry.

MLP = ("mlp/wi_0", "mlp/wi_1", "mlp/wo")
ATTENTION = ("attention/query", "attention/key", "attention/value",
             "attention/out")
REDUCE_SCATTERS = ("mlp/wo", "attention/out")


def _ring_and_off():
  """The plugin-on (ring) and plugin-off runs, trained at once."""
  return cached_train_together(
      ("llama2-7b-ts4_data2-f32-fp8-ring",
       dict(dtype="f32", plugin=RING, steps=STEPS, extra=FP8)),
      ("llama2-7b-ts4_data2-f32-fp8-off",
       dict(dtype="f32", plugin=(), steps=STEPS, extra=FP8)))


def _off():
  return _ring_and_off()[1]


def _ring():
  return _ring_and_off()[0]


def test_every_fp8_projection_and_its_gradient_matmul_is_rewritten():
  lines = _ring().decision_lines()
  for name in MLP + ATTENTION:
    forward = [l for l in lines if l.startswith(name + " ")]
    dgrad = [l for l in lines if l.startswith(name + "/dgrad ")]
    assert forward and dgrad, (name, lines)
    for line in forward:
      assert "e4m3 x e4m3 -> f32: rewritten -> ring over" in line, line
      assert ("(matmul + reduce-scatter)" in line) == (
          name in REDUCE_SCATTERS), line
    for line in dgrad:
      # The gradient's matmul is the other collective.
      assert "e5m2 x e4m3 -> f32: rewritten -> ring over" in line, line
      assert ("(matmul + reduce-scatter)" in line) != (
          name in REDUCE_SCATTERS), line


def test_fp8_trains_to_the_same_losses_as_plugin_off():
  ring, off = _ring(), _off()
  assert sorted(ring.losses) == sorted(off.losses) == list(range(STEPS))
  for step, loss in off.losses.items():
    assert abs(ring.losses[step] - loss) <= LOSS_RTOL * abs(loss), (
        ring.losses, off.losses)


def test_fp8_state_and_parameters_match_plugin_off():
  ring = _ring().checkpoint(CHECKPOINT_STEP)
  off = _off().checkpoint(CHECKPOINT_STEP)
  assert ring.keys() == off.keys()
  fp8_state = [k for k in off if "Fp8DirectDotGeneralOp_0" in k]
  # Three scales and three amax histories per fp8 projection.
  assert len(fp8_state) == 6 * len(MLP + ATTENTION)
  for key in fp8_state:
    assert ring[key].shape == off[key].shape, key
    if key.endswith("_scale']"):
      np.testing.assert_allclose(ring[key], off[key], rtol=SCALE_RTOL,
                                 err_msg=key)
    else:
      # Every step's amax, in the same places.
      np.testing.assert_array_equal(ring[key] != 0, off[key] != 0,
                                    err_msg=key)
      assert np.count_nonzero(off[key][0]) == STEPS, key
      np.testing.assert_allclose(ring[key], off[key], rtol=AMAX_RTOL,
                                 err_msg=key)
  for key in off:
    if key.startswith("['params']"):
      np.testing.assert_allclose(
          ring[key], off[key], rtol=0,
          atol=PARAM_ATOL * np.max(np.abs(off[key])), err_msg=key)
