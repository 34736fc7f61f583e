"""The DenseGeneral route: MaxText's `_compute_dot_general_nnx`, patched.

At trace time, the dot_general of a known projection in a training graph
(`projections.PROJECTIONS`, found from the owners' frames) becomes
`collective_matmul.logical_dot_general` with the activation's and result's
logical axes, alone or with its siblings (`siblings`); one of
`quantization=fp8` (Flax's `Fp8DirectDotGeneralOp` in a `ToNNX`, MaxText's
`quant_dot_general`) or of Qwix's `fp8_gpu` (`quantization`) runs
`fp8.Fp8DirectDotGeneralOp` on the same variables, alone (each has its own
scales). Anything else takes MaxText's own code, and the decision record
says why (`not_served_reason`).
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

from collective_matmul import config as config_lib
from collective_matmul import override
from collective_matmul import record
from collective_matmul.integrations.maxtext import frames
from collective_matmul.integrations.maxtext import projections
from collective_matmul.integrations.maxtext import quantization
from collective_matmul.integrations.maxtext import siblings


def not_served_reason(stack, inputs, kernel, quant_dot_general, kernel_scale,
                       native_fp8_compute, qwix=None):
  """(reason or None, projection, name) for the innermost DenseGeneral;
  `qwix`: its `frames.qwix_mode`."""
  dense = stack[-1].module
  kernel_axes = tuple(getattr(dense, "kernel_axes", ()) or ())
  owners = [f for f in stack[:-1] if f.kind != "dense"]
  owner = owners[-1] if owners else None
  name = frames.projection_name(owners, dense) or f"dense{kernel_axes}"
  if quant_dot_general is not None and _flax_fp8_op(quant_dot_general) is None:
    wrapped = getattr(quant_dot_general, "to_nnx__module", quant_dot_general)
    return (f"quantized (quant config: {type(wrapped).__name__})", None,
            name)
  if (kernel_scale is not None or native_fp8_compute or
      "float8" in str(getattr(kernel, "dtype", ""))):
    return "fp8 weights", None, name
  if qwix is not None and not qwix.served:
    return f"quantized: {qwix.left_reason}", None, name
  if "EXPLICIT" in str(getattr(dense, "shard_mode", "")).upper():
    return ("shard_mode=explicit (the adapter serves MaxText's logical, "
            "Auto-sharded route)"), None, name
  # A mixture-of-experts block (RoutedAndSharedMoE) holds its shared
  # experts, an MlpBlock: served as every MlpBlock where its weights are the
  # dense pattern; anything else in it is left.
  in_moe = any(f.kind == "moe" for f in owners)
  if in_moe and (owner is None or owner.kind != "mlp"):
    return "inside a mixture-of-experts block", None, name
  if owner is None:
    return (f"kernel axes {kernel_axes}: not a projection of an MlpBlock, "
            "Attention or the decoder's output head"), None, name
  if owner.prefix == "layer" and frames.attribute_name(owner.module, dense) is None:
    return (f"kernel axes {kernel_axes}: inside a decoder layer, not one of "
            "its own projections"), None, name
  projection = projections.find_projection(owner.kind, kernel_axes)
  if (owner.kind, kernel_axes) in projections.RULES_UNSHARDED:
    return rules_unsharded_reason(
        kernel_axes, *projections.RULES_UNSHARDED[owner.kind, kernel_axes]
    ), None, name
  if projection is None:
    reason = projections.LEFT.get(
        (owner.kind, kernel_axes),
        f"kernel axes {kernel_axes} are not a known {owner.kind} "
        "projection")
    if in_moe:
      reason = ("the shared experts of a mixture-of-experts block "
                f"(RoutedAndSharedMoE's MlpBlock): {reason}")
    return reason, None, name
  if owner.model_mode != frames.TRAIN:
    return (f"model_mode={owner.model_mode!r} (the adapter serves "
            "training)"), None, name
  if jnp.ndim(inputs) != len(projection.activation_axes):
    return (f"activation of rank {jnp.ndim(inputs)}, expected "
            f"{projection.activation_axes}"), None, name
  return None, projection, name


def rules_unsharded_reason(kernel_axes, what, dim, role) -> str:
  """Why `projections.RULES_UNSHARDED`'s projection is left: which rule
  leaves its kernel's dimension `dim` without a mesh axis (the active
  Flax logical axis rules, MaxText's)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  spec = tuple(nn.logical_to_mesh_axes(kernel_axes))
  name = kernel_axes[dim]
  collective = ("all-gather" if role == "output" else "reduce-scatter")
  if spec[dim] is not None:
    return (f"{what}: not served (tested only with MaxText's default rules, "
            f"which give its kernel's '{name}' no mesh axis); these rules "
            f"shard it over {spec[dim]}")
  as_tuple = lambda e: () if e is None else (e,) if isinstance(e, str) else (
      tuple(e))
  wanted = [as_tuple(axes) for logical, axes in nn.get_logical_axis_rules()
            if logical == name]
  taken = {axis: kernel_axes[d] for d, entry in enumerate(spec)
           for axis in as_tuple(entry)}
  clash = sorted({(axis, taken[axis]) for axes in wanted for axis in axes
                  if axis in taken})
  why = ", ".join(f"'{axis}', which '{other}' took first" for axis, other
                  in clash) or "none of them"
  return (f"{what}: MaxText's logical_axis_rules give its kernel's {role} "
          f"features ('{name}') no mesh axis (its rule also lists {why}, and "
          "Flax then skips the rule), so the weight is replicated over "
          f"tensor_sequence: no {collective} to overlap")


def _flax_fp8_op(quant_dot_general):
  """The Flax `Fp8DirectDotGeneralOp` that MaxText's `quantization=fp8`
  wraps in a `ToNNX` as a projection's `quant_dot_general`, or None (other
  quantization modes, and Flax's other fp8 ops, keep MaxText's path)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  module = getattr(quant_dot_general, "to_nnx__module", None)
  return module if type(module) is nn.Fp8DirectDotGeneralOp else None


def _served_fp8(quant_dot_general, call, projection, name):
  """MaxText's fp8 projection through `fp8.Fp8DirectDotGeneralOp`: the
  `ToNNX` that holds Flax's op (its variables) runs ours, with the same
  fields and variables, for `call()` (MaxText's call of it)."""
  from collective_matmul import fp8  # pylint: disable=g-import-not-at-top
  flax_op = _flax_fp8_op(quant_dot_general)
  ours = fp8.Fp8DirectDotGeneralOp(
      amax_history_length=flax_op.amax_history_length,
      e4m3_dtype=flax_op.e4m3_dtype, e5m2_dtype=flax_op.e5m2_dtype,
      lhs_axes=projection.activation_axes, rhs_axes=projection.kernel_axes,
      out_axes=projection.out_axes, result_axes=projection.result_axes,
      record_name=name, parent=None)
  # `to_nnx__module` is static data of the ToNNX, not state: swapped for
  # the call, past nnx's attribute checks, and put back.
  object.__setattr__(quant_dot_general, "to_nnx__module", ours)
  try:
    return call()
  finally:
    object.__setattr__(quant_dot_general, "to_nnx__module", flax_op)


def _served_fp8_gpu(dense_general, maxtext_path, projection, name):
  """Qwix's fp8_gpu projection: MaxText's path, in which Qwix's provider
  finds the DenseGeneral's ToNNX of Flax's fp8 op, which runs ours
  (`_served_fp8`) as `quantization=fp8`'s does."""
  def serve(to_nnx, args):
    return _served_fp8(to_nnx, functools.partial(
        to_nnx, *args, **quantization.fp8_gpu_call_kwargs()), projection,
                       name)
  with quantization.serving_fp8_gpu(dense_general, serve):
    return maxtext_path()


def _served_qwix_rowwise(qwix, maxtext_path, projection, name):
  """Qwix's fp8_full / fp8 / fp8_e4m3 / fp8_e5m2 projection: MaxText's
  path, in which Qwix's provider builds its config and calls its
  `dot_general_qt`, which runs `qwix_fp8.dot_general_qt` with that config
  (or, for a config it does not take, Qwix's own, recorded)."""
  from collective_matmul import qwix_fp8  # pylint: disable=g-import-not-at-top

  def serve(lhs, rhs, dimension_numbers, config, original):
    reason = qwix_fp8.unserved_reason(config, lhs, rhs, dimension_numbers)
    if reason is not None:
      record.record_not_served(
          name, f"left to MaxText: quantized: Qwix "
          f"quantization={qwix.quantization} with {reason}",
          lhs_shape=jnp.shape(lhs), rhs_shape=jnp.shape(rhs),
          dtype=qwix.dtype)
      return original(lhs, rhs, dimension_numbers, config)
    return qwix_fp8.dot_general_qt(
        lhs, rhs, dimension_numbers, config,
        lhs_axes=projection.activation_axes, rhs_axes=projection.kernel_axes,
        out_axes=projection.out_axes, result_axes=projection.result_axes,
        name=name)
  with quantization.serving_qwix_rowwise(serve):
    return maxtext_path()


def make_dot_general_nnx(original):
  def dot_general_nnx(inputs, kernel, axis, contract_ind, matmul_precision,
                      quant_dot_general, initializing, out_sharding=None,
                      kernel_scale=None, compute_dtype=None,
                      native_fp8_compute=False, scale_block_size=None,
                      act_calibration_method="absmax"):
    def maxtext_path():
      return original(inputs=inputs, kernel=kernel, axis=axis,
                      contract_ind=contract_ind,
                      matmul_precision=matmul_precision,
                      quant_dot_general=quant_dot_general,
                      initializing=initializing, out_sharding=out_sharding,
                      kernel_scale=kernel_scale, compute_dtype=compute_dtype,
                      native_fp8_compute=native_fp8_compute,
                      scale_block_size=scale_block_size,
                      act_calibration_method=act_calibration_method)

    stack = frames.stack()
    captured = getattr(frames.local, "captured", None)
    if captured is not None:  # `siblings.capture_call`: note it, stand in.
      qwix = frames.qwix_mode(stack)
      reason, projection, name = not_served_reason(
          stack, inputs, kernel, quant_dot_general, kernel_scale,
          native_fp8_compute, qwix)
      if reason is None and qwix is not None:
        reason = (f"Qwix {qwix.quantization}, served alone with its own fp8 "
                  "scales")
      captured.append(siblings.Captured(
          inputs, kernel, tuple(axis), tuple(contract_ind), matmul_precision,
          reason, projection, name))
      result = jax.eval_shape(functools.partial(
          lax.dot_general, dimension_numbers=captured[-1].dimension_numbers),
          inputs, kernel)
      return jnp.zeros(result.shape, result.dtype)
    # `initializing`: a quantized layer's construction calls it once on a
    # dummy input to create the quantizer's variables; no step runs it.
    if not config_lib.get_config().enabled or initializing or not stack:
      return maxtext_path()
    if stack[-1].kind == "gate":  # GateLogit calls it without a DenseGeneral.
      record_gate(stack, inputs, kernel)
      return maxtext_path()
    if stack[-1].kind != "dense":
      return maxtext_path()
    qwix = frames.qwix_mode(stack)
    reason, projection, name = not_served_reason(
        stack, inputs, kernel, quant_dot_general, kernel_scale,
        native_fp8_compute, qwix)
    if reason is not None:
      record.record_not_served(
          name, f"left to MaxText: {reason}", lhs_shape=jnp.shape(inputs),
          rhs_shape=jnp.shape(kernel),
          dtype=qwix.dtype if qwix else jnp.result_type(inputs))
      return maxtext_path()
    call = siblings.Captured(inputs, kernel, tuple(axis), tuple(contract_ind),
                             matmul_precision, None, projection, name)
    if quant_dot_general is not None:  # Flax's fp8 op: each its own scales.
      return _served_fp8(quant_dot_general, functools.partial(
          quant_dot_general, inputs, kernel, call.dimension_numbers,
          precision=None, mutable=["aqt"]), projection, name)
    if qwix is not None and qwix.rowwise:  # Qwix's own dot_general_qt.
      if quantization.qwix_initializing(stack[-1].module):
        return maxtext_path()
      return _served_qwix_rowwise(qwix, maxtext_path, projection, name)
    if qwix is not None:  # Qwix's fp8_gpu: Flax's fp8 op, as above.
      return _served_fp8_gpu(stack[-1].module, maxtext_path, projection,
                             name)
    result, group_reason = siblings.sibling_group(stack, call)
    if result is not None:
      return result
    return override.collective_dot_general(
        inputs, kernel, call.dimension_numbers,
        lax.Precision(matmul_precision),
        lhs_axes=projection.activation_axes, rhs_axes=projection.kernel_axes,
        out_axes=projection.out_axes, name=name, group_reason=group_reason)

  dot_general_nnx.__wrapped__ = original
  return dot_general_nnx


# ------------------------------------------------------------ the router gate


def record_gate(stack, inputs, kernel) -> None:
  """Records a MoE router gate (`GateLogit`) as left to MaxText."""
  gate = stack[-1].module
  owners = [f for f in stack[:-1] if f.kind not in ("dense", "gate")]
  kernel_axes = tuple(getattr(gate, "kernel_axes", ()) or ())
  outputs = kernel_axes[len(getattr(gate, "in_features_shape", (0,))):]
  if outputs and all(axis is None for axis in outputs):
    reason = (f"the router gate's kernel {kernel_axes} leaves its experts "
              "dimension unsharded: each device computes its own rows' "
              "logits, no all-gather to overlap")
  else:
    reason = (f"the router gate (kernel axes {kernel_axes}) is not a "
              "projection the adapter serves")
  record.record_not_served(
      frames.projection_name(owners, gate) or "moe/gate",
      f"left to MaxText: {reason}", lhs_shape=jnp.shape(inputs),
      rhs_shape=jnp.shape(kernel), dtype=jnp.result_type(inputs))


