"""Which quantized MaxText projections the adapter serves: Flax's
`Fp8DirectDotGeneralOp` (MaxText's `quantization=fp8`) is served; every
other quantizer keeps MaxText's path, named in the reason. Stand-in modules,
no MaxText import."""
import types

import flax.linen as nn
import jax.numpy as jnp
import pytest

from collective_matmul.integrations.maxtext import dense as dense_lib
from collective_matmul.integrations.maxtext import frames as frames_lib
from collective_matmul.integrations.maxtext import quantization

X3 = jnp.zeros((2, 8, 16))
W = jnp.zeros((16, 32))


def _mlp_stack(attr="wi_0", kernel_axes=("embed", "mlp")):
  dense = types.SimpleNamespace(kernel_axes=kernel_axes,
                                shard_mode="ShardMode.AUTO")
  owner = types.SimpleNamespace(**{attr: dense})
  return [frames_lib.Frame("mlp", owner, "train"),
          frames_lib.Frame("dense", dense)]


def _to_nnx(module):
  """What MaxText passes as `quant_dot_general`: a ToNNX holding the linen
  module."""
  return types.SimpleNamespace(to_nnx__module=module)


@pytest.mark.parametrize("attr,kernel_axes,collective", [
    ("wi_0", ("embed", "mlp"), "all_gather"),
    ("wo", ("mlp", "embed"), "reduce_scatter")])
def test_flax_fp8_projection_is_served(attr, kernel_axes, collective):
  reason, projection, name = dense_lib.not_served_reason(
      _mlp_stack(attr, kernel_axes), X3, W,
      _to_nnx(nn.Fp8DirectDotGeneralOp()), None, False)
  assert reason is None and name == f"mlp/{attr}"
  assert projection.collective == collective


@pytest.mark.parametrize("quantizer,expected", [
    (_to_nnx(nn.NANOOFp8DotGeneralOp()), "NANOOFp8DotGeneralOp"),
    (_to_nnx(nn.Dense(4)), "Dense"),
    (object(), "object"),
])
def test_other_quantizers_keep_maxtexts_path_and_are_named(quantizer,
                                                           expected):
  reason, projection, _ = dense_lib.not_served_reason(
      _mlp_stack(), X3, W, quantizer, None, False)
  assert projection is None
  assert reason == f"quantized (quant config: {expected})"


def _qwix(left_reason=""):
  return quantization.QwixMode("fp8_gpu" if not left_reason else "int8",
                               rule=None, left_reason=left_reason,
                               dtype="e4m3 x e4m3")


def test_a_qwix_fp8_gpu_projection_is_served():
  reason, projection, name = dense_lib.not_served_reason(
      _mlp_stack(), X3, W, None, None, False, _qwix())
  assert reason is None and projection is not None and name == "mlp/wi_0"


def test_a_projection_under_another_qwix_mode_is_left_with_its_reason():
  why = "Qwix quantization=int8 runs its own dot_general_qt (...)"
  reason, projection, _ = dense_lib.not_served_reason(
      _mlp_stack(), X3, W, None, None, False, _qwix(why))
  assert projection is None and reason == f"quantized: {why}"


def test_fp8_gpus_toNNX_runs_what_the_adapter_serves_once():
  """MaxText's `_apply_linen_module_in_nnx` as patched: the projection's
  own call of Flax's fp8 op is served; its first call (which creates the
  ToNNX), other classes and later calls are MaxText's."""
  original_calls = []

  def original(cls, op_id, *args, **kwargs):
    original_calls.append((cls, op_id))
    return "maxtext"

  apply = quantization.make_apply_linen_module_in_nnx(original)
  dense = types.SimpleNamespace()
  served = []
  serve = lambda to_nnx, args: served.append((to_nnx, args)) or "ours"
  with quantization.serving_fp8_gpu(dense, serve) as done:
    # Not created yet: Qwix's first call, MaxText's code creates it.
    assert apply(nn.Fp8DirectDotGeneralOp, "dot_general0", 1, 2, 3) == (
        "maxtext")
  assert not done and not served
  dense._qwix_fp8_gpu_dot_general0 = "to_nnx"
  with quantization.serving_fp8_gpu(dense, serve) as done:
    assert apply(nn.NANOOFp8DotGeneralOp, "dot_general0", 1, 2, 3) == (
        "maxtext")
  assert not done
  with quantization.serving_fp8_gpu(dense, serve) as done:
    assert apply(nn.Fp8DirectDotGeneralOp, "dot_general0", 1, 2, 3,
                 precision=None) == "ours"
    assert apply(nn.Fp8DirectDotGeneralOp, "dot_general0", 1, 2, 3) == (
        "maxtext")
  assert done == [True] and served == [("to_nnx", (1, 2, 3))]
  assert apply(nn.Fp8DirectDotGeneralOp, "dot_general0", 1, 2, 3) == "maxtext"
  assert len(original_calls) == 4


def test_a_qwix_rowwise_projection_is_served():
  rowwise = quantization.QwixMode("fp8_full", rule=None, left_reason="",
                                  dtype="e4m3 x e4m3", rowwise=True)
  reason, projection, name = dense_lib.not_served_reason(
      _mlp_stack(), X3, W, None, None, False, rowwise)
  assert reason is None and projection is not None and name == "mlp/wi_0"


def test_qwix_s_dot_general_qt_runs_what_the_adapter_serves_once():
  """Qwix's `dot_general_qt` as patched: the projection's own call (the one
  its provider makes while `serving_qwix_rowwise` waits) is served, with
  the config Qwix built and Qwix's own function to fall back on; calls
  before, after and outside are Qwix's."""
  original_calls = []

  def original(lhs, rhs, dimension_numbers, config):
    original_calls.append(config)
    return "qwix"

  dot_general_qt = quantization.make_dot_general_qt(original)
  served = []

  def serve(lhs, rhs, dimension_numbers, config, fallback):
    served.append((lhs, rhs, dimension_numbers, config, fallback))
    return "ours"
  assert dot_general_qt(1, 2, "dims", "config0") == "qwix"
  with quantization.serving_qwix_rowwise(serve):
    assert dot_general_qt(1, 2, "dims", "config1") == "ours"
    assert dot_general_qt(1, 2, "dims", "config2") == "qwix"
  assert dot_general_qt(1, 2, "dims", "config3") == "qwix"
  assert served == [(1, 2, "dims", "config1", original)]
  assert original_calls == ["config0", "config2", "config3"]


def test_qwix_s_own_first_call_of_the_model_is_not_a_step():
  """`qwix.quantize_model` calls the model once on dummy inputs outside
  MaxText's mesh, every module marked `disable_quant_stats_update`."""
  assert quantization.qwix_initializing(
      types.SimpleNamespace(disable_quant_stats_update=True))
  assert not quantization.qwix_initializing(
      types.SimpleNamespace(disable_quant_stats_update=False))
  assert not quantization.qwix_initializing(types.SimpleNamespace())
