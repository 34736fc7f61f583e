"""MaxText's Qwix quantization (`use_qwix_quantization=True`) and the adapter.

Qwix quantizes by interception: while MaxText's model runs, every
`jax.lax.dot_general` is its provider's, which takes the rule of the calling
module's path (MaxText 0.2.5: `decoder/.*layers.*`, the router gate
unquantized, `decoder/logits_dense` with `quantize_logits_proj`). A
projection the adapter rewrote would reach Qwix only as the ring's pieces
(on Hopper, where the kernels call no `dot_general`, not at all), so the
adapter asks Qwix for the projection's rule first (`qwix_mode`):

* `quantization=fp8_gpu` (`NvidaFp8Provider`): Flax's
  `Fp8DirectDotGeneralOp` in a `ToNNX` that MaxText's
  `_apply_linen_module_in_nnx` creates on the DenseGeneral
  (`_qwix_fp8_gpu_dot_general0`) for every dot_general with a rule. Served as
  `quantization=fp8` is: MaxText's own code finds (or, in Qwix's first
  call, creates) that `ToNNX`, and for the call it runs the plugin's
  `fp8.Fp8DirectDotGeneralOp` on the same variables (`serving_fp8_gpu`), so
  the state and checkpoints are MaxText's.
* `fp8_full`, `fp8`, `fp8_e4m3`, `fp8_e5m2` (`qwix.QtProvider`): Qwix's
  `dot_general_qt`, whose scales run over every non-contracting dimension
  (one per activation row, one per weight output column; absmax over the
  contracting dimension by default) and whose backward rescales the
  gradient by the weight's column scales and quantizes it per row again.
  Served rowwise (`ROWWISE_MODES`): MaxText's own code runs, and Qwix's
  provider builds its config and calls `dot_general_qt`, which for the
  projection's call runs `qwix_fp8.dot_general_qt` with that config
  (`serving_qwix_rowwise`): Qwix's calibration and quantization, the fp8
  products through the collective matmuls with the row and column scales.
  A config it does not take (`qwix_fp8.unserved_reason`) runs Qwix's own.
* `int4`, `int8`, `fp4` (`qwix.QtProvider`): Qwix's `dot_general_qt` on
  integer or fp4 values, left to MaxText (the collective matmuls take fp8
  or float operands).
* `fp8_nanoo` (`NANOOFp8Provider`): Flax's `NANOOFp8DotGeneralOp` (AMD's
  e4m3fnuz / e5m2fnuz), left to MaxText.

A rule that quantizes nothing (Qwix then runs `lax.dot_general`) is no
quantization: such projections are served as unquantized ones.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator

from collective_matmul import selection

# MaxText's name for a projection's fp8_gpu `ToNNX` on its DenseGeneral
# (`quantizations._apply_linen_module_in_nnx`), by Qwix's op id.
_FP8_GPU_ATTRIBUTE = "_qwix_fp8_gpu_{op_id}"
# Qwix's mutable collection for Flax's fp8 state in that call.
_FP8_GPU_MUTABLE = ("_overwrite_with_gradient",)
SERVED_MODE = "fp8_gpu"
_NANOO_MODE = "fp8_nanoo"
# Qwix's QtProvider modes served with rowwise scales (`qwix_fp8`).
ROWWISE_MODES = ("fp8_full", "fp8", "fp8_e4m3", "fp8_e5m2")

_local = threading.local()


@dataclasses.dataclass(frozen=True)
class QwixMode:
  """The Qwix quantization of one projection's dot_general.

  quantization: MaxText's `quantization` (None where no owner of the
    projection holds MaxText's config).
  rule: the Qwix rule that matched the projection's module path.
  left_reason: why the adapter leaves it to MaxText; "" for fp8_gpu and
    the rowwise modes, which it serves.
  dtype: what Qwix runs, as the decision record names operands
    ("e4m3 x e4m3", "int8 x int8").
  rowwise: served through `qwix_fp8` (Qwix's `dot_general_qt`, rowwise
    scales), not through Flax's fp8 op.
  """

  quantization: str | None
  rule: Any
  left_reason: str
  dtype: str
  rowwise: bool = False

  @property
  def served(self) -> bool:
    return not self.left_reason


def _current_rule():
  """The Qwix rule Qwix's provider would apply to a dot_general called from
  here (the nearest calling nnx module's path), or None outside Qwix."""
  try:
    import qwix.pallas  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return qwix.pallas.get_current_rule("dot_general")


def _short(dtype) -> str:
  return "-" if dtype is None else selection.short_dtype_name(dtype)


def _mode_name(quantization) -> str:
  """MaxText's `quantization` ("fp8_gpu"), from its enum or a string."""
  return str(getattr(quantization, "value", quantization) or "")


def _scales(rule) -> str:
  if getattr(rule, "disable_channelwise_axes", False):
    how = "one scale per tensor"
  else:
    how = ("a scale per activation row and per weight output column (its "
           "non-contracting dimensions)")
  if getattr(rule, "tile_size", None):
    how += f", tiled by {rule.tile_size} along the contracting dimension"
  return how


def qwix_mode(maxtext_configs) -> QwixMode | None:
  """The Qwix quantization of the dot_general about to run, or None.

  Args:
    maxtext_configs: MaxText configs of the projection's owners, innermost
      first (their `quantization` names the provider).
  """
  rule = _current_rule()
  if rule is None:
    return None
  quantization = next((_mode_name(c.quantization) for c in maxtext_configs
                       if hasattr(c, "quantization")), None)
  mode = f"quantization={quantization}" if quantization else "a Qwix rule"
  if quantization == SERVED_MODE:
    return QwixMode(quantization, rule, "", "e4m3 x e4m3")
  if quantization == _NANOO_MODE:
    return QwixMode(quantization, rule, (
        f"Qwix {mode}: Flax's NANOOFp8DotGeneralOp (AMD's e4m3fnuz / "
        "e5m2fnuz), which the collective matmul does not run"),
        "e4m3fnuz x e4m3fnuz")
  if rule.weight_qtype is None:  # Qwix runs lax.dot_general unquantized.
    return None
  dtype = f"{_short(rule.act_qtype)} x {_short(rule.weight_qtype)}"
  calibration = rule.act_calibration_method
  if rule.weight_calibration_method != calibration:
    calibration = (f"{calibration} (activations) / "
                   f"{rule.weight_calibration_method} (weights)")
  backward = (f"gradients {_short(rule.bwd_qtype)}, rescaled and "
              "requantized per channel in the backward"
              if getattr(rule, "bwd_qtype", None) is not None
              else "gradients unquantized")
  if quantization in ROWWISE_MODES:
    return QwixMode(quantization, rule, "", dtype, rowwise=True)
  return QwixMode(quantization, rule, (
      f"Qwix {mode} runs its own dot_general_qt (activations x weights "
      f"{dtype}, {calibration} calibration, {_scales(rule)}; {backward}); "
      "the collective matmuls take fp8 or float operands, so serving it "
      "would bypass that quantization"), dtype)


@contextlib.contextmanager
def serving_fp8_gpu(dense_general,
                    serve: Callable[[Any, tuple], Any]) -> Iterator[list]:
  """Within: MaxText's next `_apply_linen_module_in_nnx` call for Flax's
  `Fp8DirectDotGeneralOp` on `dense_general`'s `ToNNX` runs
  `serve(to_nnx, args)` instead of the ToNNX's own call; yields a list that
  holds True once it did (Qwix's first call, which creates the ToNNX, runs
  MaxText's code)."""
  served = []
  previous = getattr(_local, "pending", None)
  _local.pending = (dense_general, serve, served)
  try:
    yield served
  finally:
    _local.pending = previous


def make_apply_linen_module_in_nnx(original):
  """MaxText's `_apply_linen_module_in_nnx`, serving the call that
  `serving_fp8_gpu` waits for."""
  def apply_linen_module_in_nnx(linen_module_cls, op_id, *args, **kwargs):
    pending = getattr(_local, "pending", None)
    _local.pending = None  # Only this projection's own call.
    import flax.linen as nn  # pylint: disable=g-import-not-at-top
    if pending is None or linen_module_cls is not nn.Fp8DirectDotGeneralOp:
      return original(linen_module_cls, op_id, *args, **kwargs)
    dense_general, serve, served = pending
    to_nnx = getattr(dense_general,
                     _FP8_GPU_ATTRIBUTE.format(op_id=op_id), None)
    if to_nnx is None or len(args) != 3:
      return original(linen_module_cls, op_id, *args, **kwargs)
    served.append(True)
    # As MaxText calls it; Flax's op reads the three positional operands
    # and ignores precision and out_sharding.
    return serve(to_nnx, args)
  apply_linen_module_in_nnx.__wrapped__ = original
  return apply_linen_module_in_nnx


@contextlib.contextmanager
def serving_qwix_rowwise(serve: Callable[..., Any]) -> Iterator[None]:
  """Within: the next call of Qwix's `dot_general_qt` (the one Qwix's
  provider makes for this projection) runs `serve(lhs, rhs,
  dimension_numbers, config, original)` instead."""
  previous = getattr(_local, "pending_qt", None)
  _local.pending_qt = serve
  try:
    yield
  finally:
    _local.pending_qt = previous


def qwix_initializing(module) -> bool:
  """Whether `module` runs in `qwix.quantize_model`'s own first call of the
  model (which initializes Qwix's state on dummy inputs, outside MaxText's
  mesh; Qwix marks every module `disable_quant_stats_update` for it), not
  in a step."""
  return bool(getattr(module, "disable_quant_stats_update", False))


def make_dot_general_qt(original):
  """Qwix's `dot_general_qt`, serving the call `serving_qwix_rowwise`
  waits for."""
  def dot_general_qt(lhs, rhs, dimension_numbers, config):
    serve = getattr(_local, "pending_qt", None)
    _local.pending_qt = None  # Only this projection's own call.
    if serve is None:
      return original(lhs, rhs, dimension_numbers, config)
    return serve(lhs, rhs, dimension_numbers, config, original)
  dot_general_qt.__wrapped__ = original
  return dot_general_qt


def fp8_gpu_call_kwargs() -> dict[str, Any]:
  """The keywords MaxText's fp8_gpu call of a ToNNX passes."""
  return {"mutable": list(_FP8_GPU_MUTABLE)}
