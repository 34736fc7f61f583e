"""Flax's fp8 matmul with its fp8 products through the drop-in `dot_general`.

`fp8_scaled_dot_general` is `flax.linen.fp8_ops.fp8_scaled_dot_general`
with the same scaling math, done by Flax's own functions (`in_q`, `out_dq`,
`update_fp8_meta`, `quantize`, `dequantize`) on the global arrays, outside
any `shard_map`: every amax is the global one, and the scales and amax
histories it returns as gradients are those Flax's program returns. Only
the products differ in where they run, and in where two of them are
dequantized:

* forward, `q_lhs x q_rhs` (e4m3 x e4m3): the drop-in, which serves an
  all-gather-then-matmul (or, given the result's layout, a
  matmul-then-reduce-scatter) as a collective matmul, with the product of
  the two scales as its `scale`: a collective matmul multiplies its f32
  accumulation by it before the cast (the kernels in their epilogue, as
  cuBLASLt fuses the scales), where Flax rounds the product to the result
  dtype and then multiplies it by the scale (rounded to that dtype too);
* dgrad, `q_g x q_rhs` (e5m2 x e4m3): the drop-in, told the result's layout
  (the lhs's: its sharding in Explicit mode, its logical axes otherwise),
  so an all-gather matmul's dgrad is served as a matmul + reduce-scatter
  and the other way round; scaled as the forward is;
* wgrad, `q_g x q_lhs` (e5m2 x e4m3, contracting the rows): XLA's, as in
  Flax's program (a contraction over the rows is neither pattern),
  dequantized after, as Flax does.

A product the drop-in leaves to XLA (and every product with the plugin
off) is dequantized after, exactly as in Flax's program.

`Fp8DirectDotGeneralOp` is Flax's module of that name (the same variables,
collection, names, shapes, dtypes and initialisers: it subclasses
`Fp8DotGeneralBase`) computing with this function, for a linen layer's
`dot_general_cls`. This module imports Flax; `import collective_matmul`
does not import it (the package resolves these names on first use).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

from flax.linen import fp8_ops
import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from collective_matmul import config as config_lib
from collective_matmul import override
from collective_matmul import record

_E4M3 = jnp.float8_e4m3fn
_E5M2 = jnp.float8_e5m2
# Flax's own helpers, used as its fp8 ops use them.
# pylint: disable=protected-access
_to_f32 = fp8_ops._fm32_to_float32
_parse_dot_inputs = fp8_ops._parse_dot_inputs
# pylint: enable=protected-access


def _dequantized(product, preferred_element_type, a, b):
  """`product(scale)` (a product of operands quantized with the scales `a`
  and `b`, Flax's shape-(1,) variables) dequantized: the f32 scalar `a * b`
  applied in its f32 accumulation. Without `preferred_element_type` (an
  fp8 product) as Flax does it: the product, then `dequantize` into the
  default float."""
  scale = _to_f32(a) * _to_f32(b)
  if preferred_element_type is None:
    return fp8_ops.dequantize(product(None), None, scale)
  return product(jnp.reshape(scale, ()))


def _transpose_dims(dimension_numbers, x_ndim, y_ndim, swap_ans=False):
  """The product that transposes `dot_general(x, y, dimension_numbers)`
  onto x, as Flax's `dot_general_transpose_lhs` builds it: the dimension
  numbers of `dot_general(g, y, ...)`, and `perm`, the x dimension of each
  of that product's dimensions (x's layout is the product transposed by
  `argsort(perm)`)."""
  (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
  x_kept = [d for d in range(x_ndim) if d not in (*x_contract, *x_batch)]
  y_kept = [d for d in range(y_ndim) if d not in (*y_contract, *y_batch)]
  start_y = len(x_batch) + (0 if swap_ans else len(x_kept))
  ans_batch = tuple(range(len(x_batch)))
  ans_y = tuple(range(start_y, start_y + len(y_kept)))
  dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(y_batch)))
  x_contract_by_y = list(np.take(x_contract, np.argsort(y_contract)))
  perm = [int(d) for d in (*x_batch, *x_kept, *x_contract_by_y)]
  return dims, perm


def _swapped(dimension_numbers):
  (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
  return (y_contract, x_contract), (y_batch, x_batch)


def _permuted_sharding(sharding, perm):
  """`sharding` (of an array laid out as x) for x's dimensions in the order
  `perm`."""
  spec = tuple(sharding.spec) + (None,) * (len(perm) - len(sharding.spec))
  return jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec(*(spec[d] for d in perm)))


def _is_explicit(array) -> bool:
  sharding = getattr(jax.typeof(array), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  return mesh is not None and not mesh.empty and any(
      t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def _mesh_axes(axes) -> list[tuple[str, ...]]:
  """The mesh axes of each logical name under the active rules, without
  those of size 1 in the current mesh (they shard nothing)."""
  mesh = jax.sharding.get_abstract_mesh()
  sizes = {} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes))
  return [tuple(m for m in ((a,) if isinstance(a, str) else a or ())
                if sizes.get(m) != 1)
          for a in nn.logical_to_mesh_axes(axes)]


def cotangent_axes(lhs_axes, rhs_axes, dimension_numbers):
  """The logical names of the product's result, as the all-gather matmul
  lays it out: the lhs's free dimensions, where a name sharing a mesh axis
  with the rhs's free dimensions gives way (the all-gather removes it),
  then the rhs's free dimensions. Read under the active axis rules."""
  (lhs_contract, rhs_contract), _ = dimension_numbers
  lhs_free = [d for d in range(len(lhs_axes)) if d not in lhs_contract]
  rhs_free = [d for d in range(len(rhs_axes)) if d not in rhs_contract]
  lhs_mesh, rhs_mesh = _mesh_axes(lhs_axes), _mesh_axes(rhs_axes)
  taken = {a for d in rhs_free for a in rhs_mesh[d]}
  return (tuple(None if taken & set(lhs_mesh[d]) else lhs_axes[d]
                for d in lhs_free) + tuple(rhs_axes[d] for d in rhs_free))


@dataclasses.dataclass(frozen=True)
class Fp8Dots:
  """How the fp8 products of one `fp8_scaled_dot_general` reach the drop-in
  (hashable: `quantized_dot`'s static argument).

  lhs_axes, rhs_axes: the operands' logical axis names, or None to read
    their explicit shardings.
  out_axes: the result's logical names (the forward's `out_axes`), or None.
  grad_axes: the cotangent's logical names (the dgrad's lhs).
  out_sharding: the forward's `out_sharding` (Explicit mode), or None.
  name: labels the decision records (the dgrad's gets
    `record.GRADIENT_SUFFIX`).
  config: a `CollectiveMatmulConfig` instead of the active one.
  """

  lhs_axes: tuple[Any, ...] | None = None
  rhs_axes: tuple[Any, ...] | None = None
  out_axes: tuple[Any, ...] | None = None
  grad_axes: tuple[Any, ...] | None = None
  out_sharding: Any = None
  name: str | None = None
  config: config_lib.CollectiveMatmulConfig | None = None

  def forward(self, q_lhs, q_rhs, dimension_numbers, preferred_element_type,
              scale, row_scale=None, col_scale=None):
    """The dequantized product `q_lhs x q_rhs` times `scale` (and the row
    and column scales: `override.collective_dot_general`'s)."""
    return override.collective_dot_general(
        q_lhs, q_rhs, dimension_numbers, lax.Precision.DEFAULT,
        preferred_element_type, self.out_sharding, lhs_axes=self.lhs_axes,
        rhs_axes=self.rhs_axes, out_axes=self.out_axes, name=self.name,
        config=self.config, scale=scale, row_scale=row_scale,
        col_scale=col_scale)

  def dgrad(self, q_g, q_lhs, q_rhs, dimension_numbers,
            preferred_element_type, scale, row_scale=None):
    """The lhs's gradient, `q_g x q_rhs` times `scale` (and `row_scale`,
    one per row of `q_g`), dequantized, in the lhs's layout."""
    dims, perm = _transpose_dims(dimension_numbers, q_lhs.ndim, q_rhs.ndim)
    out_sharding = out_axes = None
    if self.lhs_axes is not None:
      out_axes = tuple(self.lhs_axes[d] for d in perm)
    elif _is_explicit(q_lhs):
      out_sharding = _permuted_sharding(jax.typeof(q_lhs).sharding, perm)
    product = override.collective_dot_general(
        q_g, q_rhs, dims, lax.Precision.HIGHEST, preferred_element_type,
        out_sharding, lhs_axes=self.grad_axes, rhs_axes=self.rhs_axes,
        out_axes=out_axes, name=None if self.name is None
        else self.name + record.GRADIENT_SUFFIX, config=self.config,
        scale=scale, row_scale=row_scale)
    return lax.transpose(product, tuple(np.argsort(perm)))

  def wgrad(self, q_g, q_lhs, q_rhs, dimension_numbers,
            preferred_element_type):
    """The rhs's gradient before dequantization, `q_g x q_lhs` over the
    rows, in the rhs's layout, as XLA partitions it."""
    dims, perm = _transpose_dims(_swapped(dimension_numbers), q_rhs.ndim,
                                 q_lhs.ndim, swap_ans=True)
    product = functools.partial(
        lax.dot_general, dimension_numbers=dims,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=preferred_element_type)
    if _is_explicit(q_rhs):
      # The operands' rows are sharded differently (the lhs's over the
      # collective's axis, the cotangent's not), which Explicit mode
      # refuses to guess about: XLA places the gather as in Auto mode.
      product = jax.sharding.auto_axes(
          product,
          out_sharding=_permuted_sharding(jax.typeof(q_rhs).sharding, perm))
    return lax.transpose(product(q_g, q_lhs), tuple(np.argsort(perm)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def quantized_dot(lhs, q_lhs, lhs_scale, rhs, q_rhs, rhs_scale,
                  out_grad_scale, out_grad_amax_history, dimension_numbers,
                  preferred_element_type, dots: Fp8Dots):
  """Flax's `quantized_dot` (the same arguments, plus `dots`) and its
  `out_dq` in one, its products run by `dots`: the fp8 product forward,
  dequantized by `lhs_scale * rhs_scale`; backward (as Flax's, whose
  `out_dq` passes the cotangent through), the cotangent's scale and amax
  history updated (returned as their gradients), the cotangent quantized
  to e5m2, and the two gradient products dequantized into the gradients of
  `lhs` and `rhs`."""
  del lhs, rhs, out_grad_scale, out_grad_amax_history
  return _dequantized(
      functools.partial(dots.forward, q_lhs, q_rhs, dimension_numbers,
                        preferred_element_type),
      preferred_element_type, lhs_scale, rhs_scale)


def _quantized_dot_fwd(lhs, q_lhs, lhs_scale, rhs, q_rhs, rhs_scale,
                       out_grad_scale, out_grad_amax_history,
                       dimension_numbers, preferred_element_type, dots):
  out = _dequantized(
      functools.partial(dots.forward, q_lhs, q_rhs, dimension_numbers,
                        preferred_element_type),
      preferred_element_type, lhs_scale, rhs_scale)
  return out, (lhs, q_lhs, lhs_scale, rhs, q_rhs, rhs_scale, out_grad_scale,
               out_grad_amax_history)


def _quantized_dot_bwd(dimension_numbers, preferred_element_type, dots, res,
                       g):
  (_, q_lhs, lhs_scale, _, q_rhs, rhs_scale, out_grad_scale,
   out_grad_amax_history) = res
  new_out_grad_scale, new_out_grad_amax_history = fp8_ops.update_fp8_meta(
      g, _E5M2, out_grad_scale, out_grad_amax_history)
  q_g = fp8_ops.quantize(g, _E5M2, _to_f32(new_out_grad_scale),
                         preferred_element_type)
  grad_lhs = _dequantized(
      functools.partial(dots.dgrad, q_g, q_lhs, q_rhs, dimension_numbers,
                        preferred_element_type),
      preferred_element_type, rhs_scale, new_out_grad_scale)
  grad_rhs = fp8_ops.dequantize(
      dots.wgrad(q_g, q_lhs, q_rhs, dimension_numbers,
                 preferred_element_type),
      preferred_element_type,
      _to_f32(lhs_scale) * _to_f32(new_out_grad_scale))
  return (grad_lhs, None, None, grad_rhs, None, None, new_out_grad_scale,
          new_out_grad_amax_history)


quantized_dot.defvjp(_quantized_dot_fwd, _quantized_dot_bwd)


def _tuple_or_none(axes):
  return None if axes is None else tuple(axes)


def make_dots(dimension_numbers, out_sharding, lhs_axes, rhs_axes, out_axes,
              result_axes, name, config) -> Fp8Dots:
  """The `Fp8Dots` of one fp8 matmul from its caller's arguments (those of
  `fp8_scaled_dot_general`), the cotangent's logical names resolved."""
  if (lhs_axes is None) != (rhs_axes is None):
    raise ValueError("give both lhs_axes and rhs_axes, or neither")
  lhs_axes, rhs_axes = _tuple_or_none(lhs_axes), _tuple_or_none(rhs_axes)
  out_axes = _tuple_or_none(out_axes)
  cfg = config or config_lib.get_config()
  grad_axes = _tuple_or_none(result_axes) or out_axes
  if lhs_axes is not None and cfg.enabled and grad_axes is None:
    grad_axes = cotangent_axes(lhs_axes, rhs_axes, dimension_numbers)
  return Fp8Dots(lhs_axes, rhs_axes, out_axes, grad_axes, out_sharding,
                 name, config)


def fp8_scaled_dot_general(
    lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
    out_sharding=None, *, lhs_scale, rhs_scale, grad_scale,
    lhs_amax_history, rhs_amax_history, grad_amax_history,
    quantize_compute_type=jnp.float32,
    lhs_axes: Sequence[str | None] | None = None,
    rhs_axes: Sequence[str | None] | None = None,
    out_axes: Sequence[str | None] | None = None,
    result_axes: Sequence[str | None] | None = None,
    name: str | None = None,
    config: config_lib.CollectiveMatmulConfig | None = None):
  """`flax.linen.fp8_ops.fp8_scaled_dot_general`, its fp8 products through
  the drop-in `dot_general`.

  Both operands are quantized to e4m3 with their delayed scales, the
  product is dequantized into `preferred_element_type` (by a collective
  matmul in its f32 accumulation, rounded once; left to XLA, after the
  product, as Flax does: module docstring); the backward quantizes the
  cotangent to e5m2. The scales and amax histories come back
  as the gradients of `*_scale` and `*_amax_history` (Flax's
  `_overwrite_with_gradient` convention).

  Args:
    lhs, rhs, dimension_numbers, preferred_element_type: as in
      `lax.dot_general`.
    precision: ignored, as by Flax (the products run at DEFAULT forward,
      HIGHEST backward).
    out_sharding: the result's sharding (Explicit mode), as in
      `lax.dot_general`.
    lhs_scale, rhs_scale, grad_scale, lhs_amax_history, rhs_amax_history,
    grad_amax_history, quantize_compute_type: as in Flax's function.
    lhs_axes, rhs_axes, out_axes: logical axis names, as in
      `logical_dot_general` (None: read explicit shardings).
    result_axes: the logical names of the result as the collective matmul
      lays it out (the cotangent's, for the dgrad's matmul); default:
      `out_axes`, else `cotangent_axes(lhs_axes, rhs_axes)`. Give them
      where the active rules cannot resolve those (a mesh axis of a kernel
      name also claimed by an activation name).
    name: labels the decision records.
    config: a `CollectiveMatmulConfig` instead of the active one.
  """
  del precision  # Flax sets the products' precision itself.
  dots = make_dots(dimension_numbers, out_sharding, lhs_axes, rhs_axes,
                   out_axes, result_axes, name, config)
  q_lhs, new_lhs_scale = fp8_ops.in_q(quantize_compute_type, _E4M3, lhs,
                                      lhs_scale, lhs_amax_history)
  q_rhs, new_rhs_scale = fp8_ops.in_q(quantize_compute_type, _E4M3, rhs,
                                      rhs_scale, rhs_amax_history)
  return quantized_dot(lhs, q_lhs, new_lhs_scale, rhs, q_rhs, new_rhs_scale,
                       grad_scale, grad_amax_history, dimension_numbers,
                       preferred_element_type, dots)


class Fp8DirectDotGeneralOp(fp8_ops.Fp8DotGeneralBase):
  """Flax's `Fp8DirectDotGeneralOp`, its fp8 products through the drop-in
  `dot_general`: the same variables (collection `_overwrite_with_gradient`,
  names, shapes, dtypes, initialisers) and the same math, for a linen
  layer's `dot_general_cls`:

  >>> layer = nn.Dense(features, dot_general_cls=cm.Fp8DirectDotGeneralOp)

  On an Explicit mesh the operands' shardings say where the collectives
  are; for Auto-sharded models give the logical axis names, e.g.
  `functools.partial(cm.Fp8DirectDotGeneralOp, lhs_axes=(...),
  rhs_axes=(...))`.

  Attributes:
    lhs_axes, rhs_axes, out_axes: logical axis names of the activation, the
      kernel and the result, as in `logical_dot_general`; None (default):
      read the operands' explicit shardings.
    result_axes: the result's logical names as the collective matmul lays
      it out, for the gradient's matmul (`fp8_scaled_dot_general`).
    config: a `CollectiveMatmulConfig` instead of the active one.
    record_name: labels the decision records (default: the path of the
      layer that calls this op).
  """

  lhs_axes: Sequence[str | None] | None = None
  rhs_axes: Sequence[str | None] | None = None
  out_axes: Sequence[str | None] | None = None
  result_axes: Sequence[str | None] | None = None
  config: config_lib.CollectiveMatmulConfig | None = None
  record_name: str | None = None

  def __call__(self, *args, out_sharding=None, **kwargs):
    x, k, dimension_numbers, comp_dtype = _parse_dot_inputs(*args, **kwargs)
    return fp8_scaled_dot_general(
        x, k, dimension_numbers, preferred_element_type=x.dtype,
        out_sharding=out_sharding,
        lhs_scale=self.input_scale.value,
        rhs_scale=self.kernel_scale.value,
        grad_scale=self.output_grad_scale.value,
        lhs_amax_history=self.input_amax_history.value,
        rhs_amax_history=self.kernel_amax_history.value,
        grad_amax_history=self.output_grad_amax_history.value,
        quantize_compute_type=comp_dtype, lhs_axes=self.lhs_axes,
        rhs_axes=self.rhs_axes, out_axes=self.out_axes,
        result_axes=self.result_axes,
        name=self.record_name or "/".join(self.scope.path[:-1]) or None,
        config=self.config)
