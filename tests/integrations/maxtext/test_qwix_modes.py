"""Every Qwix quantization MaxText 0.2.5 accepts, as the adapter sees it
inside Qwix's interception (in process, no training): fp8_gpu served
through Flax's fp8 op, fp8_full / fp8 / fp8_e4m3 / fp8_e5m2 served rowwise,
every other mode left to MaxText with its dtypes and scales in the reason,
and a module no rule matches (the logits) not quantized at all. The
training runs are in test_qwix_training.py."""
import flax.nnx as nnx
import jax.numpy as jnp
import pytest

from collective_matmul.integrations.maxtext import quantization
import maxtext_runs

# Module paths as Qwix sees MaxText's (its rules: decoder/.*layers.*, the
# router gate `.*/gate$`, decoder/logits_dense with quantize_logits_proj).
_MLP_PATH = ("decoder", "layers", "mlp", "wi_0")
_LOGITS_PATH = ("decoder", "logits_dense")
# With use_qwix_quantization=True (`quantizations.get_qt_provider`).
QWIX_MODES = sorted(["fp4", "int4", "int8", "fp8_e5m2", "fp8_e4m3", "fp8",
                     "fp8_nanoo", "fp8_gpu", "fp8_full"])


def _config(mode):
  from maxtext.configs import pyconfig  # pylint: disable=g-import-not-at-top
  return pyconfig.initialize([
      "test", maxtext_runs.maxtext_base_yml(), "run_name=qwix_modes",
      "hardware=cpu", "skip_jax_distributed_system=True",
      "enable_checkpointing=False", "log_config=False",
      "use_qwix_quantization=True", f"quantization={mode}"])


def _qwix_modes():
  """MaxText's quantization values that Qwix serves (`get_qt_provider`
  gives a provider for them)."""
  from maxtext.configs import types  # pylint: disable=g-import-not-at-top
  from maxtext.layers import quantizations  # pylint: disable=g-import-not-at-top
  base = _config("int8")

  class Config:  # MaxText's, with another `quantization`.
    def __init__(self, mode):
      self.quantization = mode

    def __getattr__(self, name):
      return getattr(base, name)

  return [value.value for value in types.QuantizationType
          if value.value and
          quantizations.get_qt_provider(Config(value.value)) is not None]


class _Probe(nnx.Module):
  """Asks the adapter's question where a DenseGeneral would."""

  def __init__(self, config):
    self.config = config

  def __call__(self, x):
    self.seen = quantization.qwix_mode([self.config])
    return x


def _seen(mode, path):
  import qwix  # pylint: disable=g-import-not-at-top
  from maxtext.layers import quantizations  # pylint: disable=g-import-not-at-top
  config = _config(mode)
  probe = _Probe(config)
  x = jnp.zeros((1,))
  model = qwix.quantize_model(probe, quantizations.get_qt_provider(config), x,
                              skip_nnx_init=True)
  for _, module in nnx.iter_modules(model):
    module.qwix_path = path
  model(x)
  return model.seen


def test_the_modes_are_those_maxtext_0_2_5_accepts():
  assert sorted(_qwix_modes()) == QWIX_MODES


ROWWISE = {"fp8_full": "e4m3 x e4m3", "fp8": "e4m3 x e4m3",
           "fp8_e4m3": "e4m3 x e4m3", "fp8_e5m2": "e5m2 x e5m2"}


@pytest.mark.parametrize("mode", QWIX_MODES)
def test_a_qwix_mode_is_served_as_fp8_gpu_or_rowwise_and_else_left_with_why(
    mode):
  seen = _seen(mode, _MLP_PATH)
  assert seen is not None and seen.quantization == mode
  if mode == "fp8_gpu":
    assert seen.served and not seen.rowwise and seen.dtype == "e4m3 x e4m3"
    return
  if mode in ROWWISE:
    assert seen.served and seen.rowwise and seen.dtype == ROWWISE[mode]
    return
  assert not seen.served
  assert f"quantization={mode}" in seen.left_reason
  expected = {"fp4": "float4_e2m1fn x float4_e2m1fn", "int4": "int4 x int4",
              "int8": "int8 x int8",
              "fp8_nanoo": "e4m3fnuz x e4m3fnuz"}[mode]
  assert seen.dtype == expected
  if mode != "fp8_nanoo":
    assert "a scale per activation row and per weight output column" in (
        seen.left_reason)
    assert "bypass" in seen.left_reason


@pytest.mark.parametrize("mode", ["fp8_gpu", "fp8_full", "int8"])
def test_a_module_no_qwix_rule_matches_is_not_quantized(mode):
  assert _seen(mode, _LOGITS_PATH) is None
