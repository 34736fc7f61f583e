"""Which quantized MaxText projections the adapter serves: Flax's
`Fp8DirectDotGeneralOp` (MaxText's `quantization=fp8`) is served; every
other quantizer keeps MaxText's path, named in the reason. Stand-in modules,
no MaxText import."""
import types

import flax.linen as nn
import jax.numpy as jnp
import pytest

from collective_matmul.integrations.maxtext import adapter

X3 = jnp.zeros((2, 8, 16))
W = jnp.zeros((16, 32))


def _mlp_stack(attr="wi_0", kernel_axes=("embed", "mlp")):
  dense = types.SimpleNamespace(kernel_axes=kernel_axes,
                                shard_mode="ShardMode.AUTO")
  owner = types.SimpleNamespace(**{attr: dense})
  return [adapter._Frame("mlp", owner, "train"),
          adapter._Frame("dense", dense)]


def _to_nnx(module):
  """What MaxText passes as `quant_dot_general`: a ToNNX holding the linen
  module."""
  return types.SimpleNamespace(to_nnx__module=module)


@pytest.mark.parametrize("attr,kernel_axes,collective", [
    ("wi_0", ("embed", "mlp"), "all_gather"),
    ("wo", ("mlp", "embed"), "reduce_scatter")])
def test_flax_fp8_projection_is_served(attr, kernel_axes, collective):
  reason, projection, name = adapter._not_served_reason(
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
  reason, projection, _ = adapter._not_served_reason(
      _mlp_stack(), X3, W, quantizer, None, False)
  assert projection is None
  assert reason == f"quantized (quant config: {expected})"
