"""Qwix's quantized `dot_general` in its fp8 modes, the fp8 products through
the drop-in `dot_general` with Qwix's rowwise scales.

`dot_general_qt` is `qwix._src.core.dot_general_qt.dot_general_qt` (Qwix
0.1.8; what `qwix.QtProvider` runs for MaxText's `fp8_full`, `fp8`,
`fp8_e4m3` and `fp8_e5m2`) for the configs `unserved_reason` accepts. The
calibration and the quantization are Qwix's own functions on the global
arrays, outside any `shard_map` (a scale whose absmax runs over a sharded
dimension is a cross-device max, which XLA computes as in Qwix's program);
only two products run elsewhere:

* forward, `q_lhs x q_rhs`: through the drop-in, with the activation's
  scales (one per row: absmax over the contracting dimension) as its
  `row_scale` and the weight's (one per output column) as its `col_scale`,
  applied to the f32 accumulation (Qwix multiplies its product by them in
  the result's dtype);
* dlhs, Qwix's gradient quantization (the cotangent times the weight's
  column scales, quantized per row to `dlhs_grad_qtype`) times the weight's
  fp8 values: through the drop-in in the lhs's layout (an all-gather
  matmul's is a matmul + reduce-scatter and the other way round), with the
  cotangent's row scales as its `row_scale`;
* drhs: Qwix's own backward (a contraction over the rows, neither pattern),
  gradient clipping included; of its results only the weight's gradient is
  used.

The scales are constants of differentiation, as in Qwix (its custom VJP
returns no cotangent for the calibration). This module imports Qwix and
Flax; `import collective_matmul` does not import it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from qwix._src import interception
from qwix._src.core import dot_general as qwix_dot_general
from qwix._src.core import dot_general_qt as qwix_qt
from qwix._src.core import numerics
from qwix._src.core import qarray

from collective_matmul import fp8

FP8_QTYPES = tuple(jnp.dtype(t) for t in (jnp.float8_e4m3fn,
                                          jnp.float8_e5m2))


def _qtype_name(qtype) -> str:
  """`float8_e4m3fn`, `int8`, `nf4`: a Qwix qtype (a dtype or a name)."""
  if qtype is None:
    return "None"
  try:
    return jnp.dtype(qtype).name
  except TypeError:  # Qwix's named qtypes ("nf4", "mxfp8").
    return str(qtype)


def unserved_reason(config: qwix_qt.DotGeneralQtConfig, lhs, rhs,
                    dimension_numbers) -> str | None:
  """Why `dot_general_qt` cannot run `config` as Qwix does, or None: it
  serves per-channel (or per-tensor) e4m3/e5m2 operands and gradients,
  symmetric calibration, untiled, without sparsity, stochastic rounding or
  original residuals, and no batch dimensions."""
  for what, qtype in (("activation", config.lhs_qtype),
                      ("weight", config.rhs_qtype),
                      ("gradient", config.dlhs_grad_qtype)):
    if _qtype_name(qtype) not in [t.name for t in FP8_QTYPES]:
      return f"{what} qtype {_qtype_name(qtype)} is not e4m3 or e5m2"
  for what, array in (("lhs", lhs), ("rhs", rhs)):
    if not numerics.should_quantize(jnp.result_type(array)):
      return f"the {what} is {jnp.result_type(array)}, which Qwix keeps"
  if config.tile_size or config.dlhs_tile_size:
    return (f"subchannel tiles (tile_size={config.tile_size}, "
            f"dlhs_tile_size={config.dlhs_tile_size}): a scale per tile of "
            "the contraction, not per row")
  for what in ("lhs_calibration_method", "rhs_calibration_method",
               "dlhs_grad_calibration_method"):
    if getattr(config, what).lower().startswith("minmax"):
      return f"{what}={getattr(config, what)!r} (asymmetric: zero points)"
  if config.sparsity_rule is not None:
    return "weight sparsity"
  if config.dlhs_stochastic_rounding_noise_fn is not None:
    return "stochastic rounding of the gradient"
  if config.use_original_residuals:
    return "original (unquantized) residuals"
  if dimension_numbers[1][0]:
    return f"batch dimensions {dimension_numbers[1]}"
  return None


def _free_scale(q: qarray.QArray, contract) -> jax.Array:
  """A quantized array's scale as one float32 per entry of its free
  (non-contracting) dimensions: its channelwise scale, or its per-tensor
  one broadcast."""
  free = tuple(n for d, n in enumerate(q.qvalue.shape) if d not in contract)
  scale = jnp.squeeze(q.scale, axis=tuple(contract))
  return jnp.broadcast_to(scale, free).astype(jnp.float32)


@interception.disable_interceptions  # The ring's dots are not Qwix's.
def _forward_product(dots: fp8.Fp8Dots, lhs_q, rhs_q, dimension_numbers):
  (lhs_contract, rhs_contract), _ = dimension_numbers
  _, result_type = qarray.get_accumulator_and_result_type(
      lhs_q, rhs_q, preferred_element_type=None)
  return dots.forward(lhs_q.qvalue, rhs_q.qvalue, dimension_numbers,
                      result_type, None,
                      row_scale=_free_scale(lhs_q, lhs_contract),
                      col_scale=_free_scale(rhs_q, rhs_contract))


@interception.disable_interceptions
def _dlhs(dots: fp8.Fp8Dots, g, lhs_q, rhs_q, dimension_numbers, config):
  """Qwix's dlhs (`dot_general_qt_bwd`, the lhs's arm, quantized
  residuals): the cotangent times the weight's column scales, quantized
  per row, times the weight's fp8 values, through the drop-in."""
  bwd_dims, _ = qwix_qt._update_dimension_numbers_for_backward(  # pylint: disable=protected-access
      dimension_numbers, (lhs_q.ndim, rhs_q.ndim), for_dlhs=True)
  g = qwix_qt._apply_rhs_scale_to_lhs(g, rhs_q.scale, bwd_dims)  # pylint: disable=protected-access
  how = qwix_dot_general.get_how_to_quantize(
      dimension_numbers=bwd_dims, ndims=(g.ndim, rhs_q.ndim), for_lhs=True,
      qtype=config.dlhs_grad_qtype, tile_size=config.dlhs_tile_size,
      calibration_method=config.dlhs_grad_calibration_method)
  if config.dlhs_grad_disable_channelwise_axes:
    how = dataclasses.replace(how, channelwise_axes=[])
  g_q = qarray.quantize(g, how)
  _, result_type = qarray.get_accumulator_and_result_type(
      g_q, rhs_q.qvalue, preferred_element_type=None)
  return dots.dgrad(g_q.qvalue, lhs_q.qvalue, rhs_q.qvalue,
                    dimension_numbers, result_type, None,
                    row_scale=_free_scale(g_q, bwd_dims[0][0]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _quantized_dot(lhs, rhs, lhs_calibration, rhs_calibration,
                   dimension_numbers, dots, config):
  """Qwix's `dot_general_qt_fwd_bwd` (the same arguments, plus `dots`), its
  products run by `dots`."""
  out, _ = _quantized_dot_fwd(lhs, rhs, lhs_calibration, rhs_calibration,
                              dimension_numbers, dots, config)
  return out


def _quantized_dot_fwd(lhs, rhs, lhs_calibration, rhs_calibration,
                       dimension_numbers, dots, config):
  # Qwix's forward quantizes; its own product is unused (XLA drops it).
  _, residuals = qwix_qt.dot_general_qt_fwd(
      lhs, rhs, lhs_calibration, rhs_calibration, dimension_numbers, config)
  lhs_q, rhs_q = residuals[2], residuals[3]
  return (_forward_product(dots, lhs_q, rhs_q, dimension_numbers),
          residuals)


def _quantized_dot_bwd(dimension_numbers, dots, residuals, g):
  lhs_in, _, lhs_q, rhs_q, lhs_calibration, _, config = residuals
  # Qwix's backward for the weight's gradient (its dlhs is unused).
  _, drhs, *_ = interception.disable_interceptions(
      qwix_qt.dot_general_qt_bwd)(dimension_numbers, residuals, g)
  dlhs = _dlhs(dots, g, lhs_q, rhs_q, dimension_numbers, config)
  if not config.disable_gradient_clipping and lhs_calibration is not None:
    dlhs = qarray.clip_gradient_to_calibration(
        dlhs, lhs_in, lhs_calibration, config.lhs_calibration_method)
  return dlhs, drhs, None, None, None


_quantized_dot.defvjp(_quantized_dot_fwd, _quantized_dot_bwd)


def _calibration(array, dimension_numbers, ndims, for_lhs, config):
  """Qwix's calibration of one operand (`dot_general_qt`'s)."""
  qtype, method, channelwise_off, collect = (
      (config.lhs_qtype, config.lhs_calibration_method,
       config.lhs_disable_channelwise_axes, config.lhs_collect_quant_stat)
      if for_lhs else
      (config.rhs_qtype, config.rhs_calibration_method,
       config.rhs_disable_channelwise_axes, config.rhs_collect_quant_stat))
  how = qwix_dot_general.get_how_to_quantize(
      dimension_numbers=dimension_numbers, ndims=ndims, for_lhs=for_lhs,
      qtype=qtype, tile_size=config.tile_size, calibration_method=method)
  if channelwise_off:
    how = dataclasses.replace(how, channelwise_axes=[])
  calibration = qarray.calibrate(array, how)
  return collect(calibration) if collect else calibration


def dot_general_qt(lhs, rhs, dimension_numbers,
                   config: qwix_qt.DotGeneralQtConfig, *, out_sharding=None,
                   lhs_axes=None, rhs_axes=None, out_axes=None,
                   result_axes=None, name=None, cm_config=None):
  """`qwix._src.core.dot_general_qt.dot_general_qt(lhs, rhs,
  dimension_numbers, config)`, its fp8 products through the drop-in with
  Qwix's per-row and per-column scales (module docstring).

  Args:
    lhs, rhs, dimension_numbers, config: as Qwix's; `unserved_reason` must
      be None for them (a ValueError with it otherwise).
    out_sharding: the result's sharding (Explicit mode).
    lhs_axes, rhs_axes, out_axes, result_axes, name: as in
      `fp8_scaled_dot_general`.
    cm_config: a `CollectiveMatmulConfig` instead of the active one.
  """
  reason = unserved_reason(config, lhs, rhs, dimension_numbers)
  if reason is not None:
    raise ValueError(f"Qwix's dot_general_qt with {reason}: run Qwix's own")
  dots = fp8.make_dots(dimension_numbers, out_sharding, lhs_axes, rhs_axes,
                       out_axes, result_axes, name, cm_config)
  ndims = (jnp.ndim(lhs), jnp.ndim(rhs))
  return _quantized_dot(
      lhs, rhs, _calibration(lhs, dimension_numbers, ndims, True, config),
      _calibration(rhs, dimension_numbers, ndims, False, config),
      dimension_numbers, dots, config)
