"""The collective matmuls as JAX primitives, with a rule for every
transformation: `jit`, `grad`/`vjp`, `jvp`/`jacfwd`/`linearize`, `vmap`,
`hessian` and `checkpoint` compose through them.

Two primitives:

- `collective_matmul(x, w[, scale][, row_scale][, col_scale])`: y =
  all_gather(x) @ w or reduce_scatter(x @ w) (`Static.collective`),
  optionally with all_gather(x) as a second result; with scales
  (`Static.scales` says which), y = the f32 accumulation times
  row_scale[i] * col_scale[j] * scale, cast to the result's dtype.
  It carries the traced forward (`dispatch`, with the plan's impl)
  as its `impl_jaxpr`, so the kernels are traced, and their errors raised,
  where the op is called; lowering inlines that jaxpr.
- `collective_matmul_tangent(res, w, scales..., dx?, dw?)`: its tangent,
  C(dx, w) + C(x, dw) for the collective matmul C, linear in (dx, dw) with
  (res, w, scales) held (the scalar scale's own term, dscale times the
  product without it, is an ordinary product beside it; the row and column
  scales are constants of differentiation, as Qwix's `dot_general_qt`
  treats its scales: no tangent, zero cotangent). Its transpose is the
  backward: dx's cotangent through the *other* collective matmul with the
  plan's backward impl, dw's from the gathered operand, once for both (the
  forward's gathered activation where `save_gathered` kept it; for the
  reduce-scatter, the cotangent that dx's all-gather matmul assembled).
  Evaluated (forward mode) it runs C again, with the forward's impl.

Differentiating C gives C for the primal and a tangent; `grad` transposes
the tangent, binding C (the transposed collective) again, so every order of
`grad`, `jvp` and `vmap` keeps the kernels. `vmap` folds the mapped
dimension into C's operands (a leading dimension of x, or columns of w) and
maps over it only where both operands (or the scale) are mapped. Under
`jax.checkpoint`, C is split as the call of its forward, so a remat policy
judges the forward's own operations (dots, sends, a kernel).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
from jax import lax
# What `jax.extend.core` re-exports (importing `jax.extend` imports Pallas,
# which `import collective_matmul` must not).
from jax._src import core as jex_core
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir
from jax.interpreters import partial_eval as pe
import jax.numpy as jnp

from collective_matmul import dispatch
from collective_matmul import plan as plan_lib
from collective_matmul import ring
from collective_matmul.enums import Collective
from collective_matmul.kernels.configs import is_fp8


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything of one collective matmul but its operands (hashable: the
  primitives' parameter).

  `axis` is the gathered (all-gather) or scattered (reduce-scatter)
  dimension of `x`; `plan` what runs forward and backward, with each
  implementation's config; `scales`: which of `Scales` (scalar, row,
  column) follow x and w as operands; the other fields are the call's own
  arguments.
  """

  collective: Collective
  axis_name: Any
  axis: int
  plan: plan_lib.KernelPlan
  precision: Any
  preferred_element_type: Any
  save_gathered: bool
  scales: tuple[bool, bool, bool] = (False, False, False)

  @property
  def keeps_gathered(self) -> bool:
    """The all-gather matmul's forward keeps all_gather(x) for the weight
    gradient."""
    return self.collective == Collective.ALL_GATHER and self.save_gathered

  def transposed(self, out_dtype) -> Static:
    """The backward's collective matmul (dx's), writing `out_dtype`: the
    other collective with the plan's backward, whose own backward is this
    one's forward."""
    return dataclasses.replace(self, collective=self.collective.transpose,
                               plan=self.plan.transposed(),
                               preferred_element_type=out_dtype)


class Scales(NamedTuple):
  """The f32 scales of one collective matmul's product, each None or an
  array: `scale` (`()`), `row_scale` (`x.shape[:-1]`, x's rows) and
  `col_scale` (`[n]`, w's columns)."""

  scale: Any = None
  row_scale: Any = None
  col_scale: Any = None

  @property
  def present(self) -> tuple[bool, bool, bool]:
    return tuple(a is not None for a in self)

  def arrays(self) -> list:
    """The given scales, in order (the primitives' operands after x, w)."""
    return [a for a in self if a is not None]

  @classmethod
  def of(cls, present, arrays) -> Scales:
    """The scales from the operands `arrays` where `present` says."""
    arrays = iter(arrays)
    return cls(*(next(arrays) if p else None for p in present))


def _varies_over(array, axis_name) -> bool:
  """`array` is typed as varying over (one of) `axis_name` in a checking
  `shard_map`."""
  aval = jax.typeof(array)
  varying = getattr(aval, "vma", None)
  if varying is None:  # JAX >= 0.10 keeps it in the manual axis type.
    varying = getattr(getattr(aval, "mat", None), "varying", None) or ()
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  return any(name in varying for name in names)


def _check_float_result(what, result_dtype):
  if not jnp.issubdtype(result_dtype, jnp.inexact):
    raise ValueError(
        f"{what} with a {jnp.dtype(result_dtype)} result: the scaled "
        "accumulation is cast to it, truncating (0.5 gives zeros); ask for "
        "a floating-point preferred_element_type")


def check_vector_scales(row_scale, col_scale, row_shape, col_shape,
                        result_dtype, collective: Collective,
                        axis_name=None, operands="x and w"):
  """`row_scale` and `col_scale` as they enter (the ops, the drop-in):
  None, or float32 arrays of shapes `row_shape` (the rows of the lhs: the
  ops' `x.shape[:-1]`) and `col_shape` (the columns of the rhs); a
  ValueError naming the bad one otherwise (`operands` names the operands),
  with an integer result (as `check_scale`), and, for the reduce-scatter
  (every device scales its partial product of the same rows and columns),
  for one typed as varying over `axis_name`. Their values are not checked
  (they are traced): a zero entry zeroes its row or column, a negative one
  flips its sign, a NaN makes it NaN, as `acc * row_scale[i] *
  col_scale[j]` does."""
  checked = []
  for name, value, shape, what in (
      ("row_scale", row_scale, tuple(row_shape), "one per row"),
      ("col_scale", col_scale, tuple(col_shape), "one per column")):
    if value is None:
      checked.append(None)
      continue
    value = jnp.asarray(value)
    if value.shape != shape or value.dtype != jnp.float32:
      raise ValueError(
          f"{name} of shape {value.shape} and dtype {value.dtype}: expected "
          f"float32 of shape {shape} ({what} of the product of {operands})")
    _check_float_result(name, result_dtype)
    if (collective == Collective.REDUCE_SCATTER and axis_name is not None
        and _varies_over(value, axis_name)):
      raise ValueError(
          f"{name} varies over {axis_name!r}: the matmul + reduce-scatter "
          "scales every device's partial product of the same rows and "
          "columns alike (pass it replicated)")
    checked.append(value)
  return tuple(checked)


def check_scale(scale, result_dtype, axis_name=None):
  """`scale` as it enters (the ops, the drop-in): None, or a float32 scalar
  array; a ValueError otherwise, and for a scale that cannot act as one:
  with an integer result (the scaled accumulation is cast to it, so 0.5
  would give zeros), or typed as varying over `axis_name` (a `shard_map`
  that checks it: the ring scales sums where the baseline scales each
  device's terms, so they would disagree; a scale that varies unchecked is
  the caller's to avoid, as the ops' docstrings say)."""
  if scale is None:
    return None
  scale = jnp.asarray(scale)
  if scale.shape != () or scale.dtype != jnp.float32:
    raise ValueError(f"scale of shape {scale.shape} and dtype {scale.dtype}: "
                     "expected a float32 scalar (shape ())")
  _check_float_result("scale", result_dtype)
  if axis_name is not None and _varies_over(scale, axis_name):
    raise ValueError(
        f"scale varies over {axis_name!r}: a collective matmul's scale is "
        "the same on every device of its axis (pass it replicated)")
  return scale


def _forward(static: Static, return_gathered: bool):
  """The function `collective_matmul` runs: (x, w, *scales) -> [y] or
  [y, all_gather(x)]."""

  def run(x, w, *scales):
    scales = Scales.of(static.scales, scales)
    out = dispatch.collective_matmul(
        static.collective, static.plan, x, w,
        static.axis_name, static.axis, static.precision,
        static.preferred_element_type, return_gathered, scales.scale,
        row_scale=scales.row_scale, col_scale=scales.col_scale)
    return list(out) if return_gathered else [out]
  return run


def collective_matmul(x, w, static: Static, return_gathered: bool = False,
                      scale=None, row_scale=None, col_scale=None):
  """[y] or, with `return_gathered` (all-gather only), [y, all_gather(x)];
  with scales (`Scales`, each checked where it entered), y is the f32
  accumulation times them. Inside `shard_map`, over `static.axis_name`.

  The forward is traced here, once: a rule that binds the primitive again
  with the same operands passes this trace on (an all-gather matmul that
  keeps its gathered operand returns it from the start, unused unless
  differentiated, so its JVP need not trace again)."""
  return_gathered = return_gathered or static.keeps_gathered
  scales = Scales(scale, row_scale, col_scale)
  if static.scales != scales.present:
    static = dataclasses.replace(static, scales=scales.present)
  operands = (x, w, *scales.arrays())
  impl_jaxpr = jax.make_jaxpr(_forward(static, return_gathered))(*operands)
  return collective_matmul_p.bind(*operands, static=static,
                                  return_gathered=return_gathered,
                                  impl_jaxpr=impl_jaxpr)


collective_matmul_p = jex_core.Primitive("collective_matmul")
collective_matmul_p.multiple_results = True


def _run_impl_jaxpr(*args, impl_jaxpr, **_):
  return jex_core.jaxpr_as_fun(impl_jaxpr)(*args)


collective_matmul_p.def_impl(_run_impl_jaxpr)
collective_matmul_p.def_effectful_abstract_eval(
    lambda *_, impl_jaxpr, **__: (impl_jaxpr.out_avals, impl_jaxpr.effects))
mlir.register_lowering(collective_matmul_p,
                       mlir.lower_fun(_run_impl_jaxpr, multiple_results=True))


def _collective_matmul_jvp(primals, tangents, *, static, return_gathered,
                           impl_jaxpr):
  x, w, *scales = primals
  scales = Scales.of(static.scales, scales)
  dx, dw, *dscales = (None if type(t) is ad.Zero else t for t in tangents)
  # The row and column scales' tangents are dropped: constants of
  # differentiation (module docstring).
  dscale = Scales.of(static.scales, dscales).scale
  outs = collective_matmul_p.bind(*primals, static=static,
                                  return_gathered=return_gathered,
                                  impl_jaxpr=impl_jaxpr)
  y_aval = jax.typeof(outs[0])
  # The weight's tangent term multiplies the gathered activation: the one
  # the forward assembled where it kept it, else x (gathered again by the
  # term itself).
  use_gathered = return_gathered and dw is not None
  dy = None
  if dx is not None or dw is not None:
    dy = tangent(outs[1] if use_gathered else x, w, dx, dw, static,
                 gathered=use_gathered, out_aval=y_aval, scales=scales)
  if dscale is not None:
    # d(scale * acc) / d scale = acc: the product without the scalar scale
    # (run again, in the result's dtype, only where the scale's tangent is
    # not zero).
    unscaled = collective_matmul(
        x, w, dataclasses.replace(static, save_gathered=False),
        row_scale=scales.row_scale, col_scale=scales.col_scale)[0]
    acc_dtype = ring.accumulation_dtype(y_aval.dtype)
    term = (unscaled.astype(acc_dtype)
            * dscale.astype(acc_dtype)).astype(y_aval.dtype)
    dy = term if dy is None else dy + term
  if dy is None:
    dy = ad.Zero(y_aval.to_tangent_aval())
  if not return_gathered:
    return outs, [dy]
  # all_gather(x)'s tangent is all_gather(dx).
  dgathered = (ad.Zero(jax.typeof(outs[1]).to_tangent_aval()) if dx is None
               else lax.all_gather(dx, static.axis_name, axis=static.axis,
                                   tiled=True))
  return outs, [dy, dgathered]


def _collective_matmul_batch(args, dims, *, static, return_gathered,
                             impl_jaxpr):
  del impl_jaxpr
  x, w, *scales = args
  bx, bw, *bscales = dims
  scales = Scales.of(static.scales, scales)
  bs, brow, bcol = Scales.of(static.scales, bscales)
  size = next(a.shape[b] for a, b in zip(args, dims) if b is not None)

  def leading(array, axis):
    """`array` with its mapped dimension first (broadcast if unmapped)."""
    if axis is None:
      return jnp.broadcast_to(array, (size,) + array.shape)
    return jnp.moveaxis(array, axis, 0)

  if bw is None and bs is None and bcol is None:
    # A new leading dimension of x (and of its row scales), before the
    # gathered/scattered one: the kernels see its rows in runs (the plan's
    # row layouts again).
    x = leading(x, bx)
    row_scale = (None if scales.row_scale is None
                 else leading(scales.row_scale, brow))
    rows = plan_lib.kernel_rows(static.collective, x.shape, static.axis + 1,
                                lax.axis_size(static.axis_name))
    outs = collective_matmul(
        x, w, dataclasses.replace(static, axis=static.axis + 1,
                                  plan=static.plan.for_rows(*rows)),
        return_gathered, scales.scale, row_scale, scales.col_scale)
    return outs, [0] * len(outs)
  if bx is None and bs is None and brow is None:
    # The mapped weights (and their column scales) side by side: columns
    # [k, B * n].
    w = jnp.moveaxis(leading(w, bw), 0, 1)
    k, _, n = w.shape
    col_scale = (None if scales.col_scale is None
                 else leading(scales.col_scale, bcol).reshape(size * n))
    outs = collective_matmul(x, w.reshape(k, size * n), static,
                             return_gathered, scales.scale, scales.row_scale,
                             col_scale)
    y = outs[0].reshape(outs[0].shape[:-1] + (size, n))
    return ([jnp.moveaxis(y, -2, 0)] + outs[1:],
            [0] + [None] * (len(outs) - 1))
  # Both operands (or the scalar scale) mapped: one collective matmul per
  # index.

  def one(mapped):
    mapped = iter(mapped)
    x_i, w_i, *scales_i = [next(mapped) if b is not None else a
                           for a, b in zip(args, dims)]
    return tuple(collective_matmul(
        x_i, w_i, static, return_gathered,
        *Scales.of(static.scales, scales_i)))
  outs = lax.map(one, tuple(jnp.moveaxis(a, b, 0)
                            for a, b in zip(args, dims) if b is not None))
  return list(outs), [0] * len(outs)


def _collective_matmul_remat(saveable, unks_in, inst_in, eqn):
  """Under `jax.checkpoint`, the policy judges the forward's own operations
  (its dots, its communication, a kernel), as it would the same code
  inline: the equation is split as the call of its `impl_jaxpr`."""
  call = eqn.replace(primitive=jex_core.closed_call_p,
                     params={"call_jaxpr": eqn.params["impl_jaxpr"]})
  return pe.partial_eval_jaxpr_custom_rules[jex_core.closed_call_p](
      saveable, unks_in, inst_in, call)


ad.primitive_jvps[collective_matmul_p] = _collective_matmul_jvp
batching.primitive_batchers[collective_matmul_p] = _collective_matmul_batch
pe.partial_eval_jaxpr_custom_rules[collective_matmul_p] = (
    _collective_matmul_remat)


def tangent(res, w, dx, dw, static: Static, *, gathered: bool, out_aval,
            scales: Scales = Scales()):
  """C(dx, w) + C(x, dw), linear in the tangents `dx` and `dw` (None:
  zero, not both), with C's `scales` (held, `static.scales`). `res` is x,
  or all_gather(x) with `gathered`; `out_aval` is y's."""
  lin = [t for t in (dx, dw) if t is not None]
  return collective_matmul_tangent_p.bind(
      res, w, *scales.arrays(), *lin, static=static, has_dx=dx is not None,
      has_dw=dw is not None, gathered=gathered, out_aval=out_aval)


def _held(args, static):
  """(res, w, `Scales`, the tangents) of the tangent's operands."""
  held = 2 + sum(static.scales)
  return (args[0], args[1], Scales.of(static.scales, args[2:held]),
          list(args[held:]))


def _gathered_rows(row_scale, static):
  """The row scales of all_gather(x), from x's (None stays None)."""
  if row_scale is None:
    return None
  return lax.all_gather(row_scale, static.axis_name, axis=static.axis,
                        tiled=True)


def _tangent_eval(*args, static, has_dx, has_dw, gathered, out_aval):
  """The tangent in terms of `collective_matmul` (and, with `gathered`, a
  local dot): what forward mode runs, and how it is batched and
  differentiated again."""
  res, w, scales, lin = _held(args, static)
  dx = lin.pop(0) if has_dx else None
  dw = lin.pop(0) if has_dw else None
  terms = []
  if dx is not None:
    terms.append(collective_matmul(dx, w, static, False, *scales)[0])
  if dw is not None:
    if gathered:
      terms.append(ring.local_matmul(
          res, dw, precision=static.precision,
          preferred_element_type=static.preferred_element_type,
          scale=scales.scale,
          row_scale=_gathered_rows(scales.row_scale, static),
          col_scale=scales.col_scale))
    else:
      terms.append(collective_matmul(res, dw, static, False, *scales)[0])
  out = terms[0].astype(out_aval.dtype)
  for term in terms[1:]:
    out = out + term.astype(out_aval.dtype)
  return out


def _transposed_rows(row_scale, static, rows):
  """The row scales of the backward's collective matmul (its lhs is y's
  cotangent), from x's: those of all the rows (the all-gather's dx is a
  reduce-scatter over every row), or of this device's row block (the
  reduce-scatter's dx is an all-gather of the local block of `rows`)."""
  if row_scale is None:
    return None
  if static.collective == Collective.ALL_GATHER:
    return _gathered_rows(row_scale, static)
  start = lax.axis_index(static.axis_name) * rows
  return lax.dynamic_slice_in_dim(row_scale, start, rows, static.axis)


def _tangent_transpose(ct, *args, static, has_dx, has_dw, gathered,
                       out_aval):
  """The backward: cotangents of (dx, dw) from y's cotangent `ct` (y is
  linear in each, the scales held: both are scaled by them too; the
  scales themselves get none)."""
  del out_aval
  res, w, scales, lin = _held(args, static)
  if any(ad.is_undefined_primal(a) for a in (res, w, *scales)):
    raise ValueError("collective_matmul_tangent is linear in its tangents "
                     "only")
  dx_aval = lin.pop(0).aval if has_dx else None
  dw_aval = lin.pop(0).aval if has_dw else None
  ct = ad.instantiate_zeros(ct)
  if scales.col_scale is not None:
    # Both gradients contract y's columns: the cotangent meets the column
    # scales first (rounded to its dtype once).
    ct = ring.scaled(ct.astype(ring.accumulation_dtype(ct.dtype)),
                     col_scale=scales.col_scale).astype(ct.dtype)
  ct_b, w_t = dispatch.times_weight_transposed(ct, w)
  # An fp8 operand's cotangent is written in the cotangent's dtype and
  # rounded to fp8 once, at the end (as lax's dot_general transpose does),
  # not summed across the ring in fp8.
  dx_dtype = None
  if has_dx:
    dx_dtype = ct_b.dtype if is_fp8(dx_aval.dtype) else dx_aval.dtype
  dx_rows = _transposed_rows(scales.row_scale, static,
                             ct.shape[static.axis])
  ct_dx = ct_dw = gathered_ct = None
  if static.collective == Collective.ALL_GATHER:
    # y = all_gather(x) @ w: dx = reduce_scatter(dy @ w.T),
    # dw = all_gather(x).T @ dy.
    if has_dx:
      ct_dx = collective_matmul(ct_b, w_t, static.transposed(dx_dtype),
                                scale=scales.scale, row_scale=dx_rows)[0]
    if has_dw:
      x_all = res if gathered else lax.all_gather(
          res, static.axis_name, axis=static.axis, tiled=True)
      ct_dw = dispatch.contract_leading(
          x_all, _rows_scaled(ct, dx_rows), static.precision)
  else:
    # y = reduce_scatter(x @ w): dx = all_gather(dy) @ w.T,
    # dw = x.T @ all_gather(dy), from the gathered dy dx's all-gather
    # matmul assembled where `save_gathered` keeps it.
    if has_dx:
      keep = static.save_gathered and has_dw
      outs = collective_matmul(ct_b, w_t, static.transposed(dx_dtype),
                               return_gathered=keep, scale=scales.scale,
                               row_scale=dx_rows)
      ct_dx = outs[0]
      gathered_ct = outs[1] if keep else None
    if has_dw:
      if gathered_ct is None:
        gathered_ct = lax.all_gather(ct_b, static.axis_name,
                                     axis=static.axis, tiled=True)
      ct_dw = dispatch.contract_leading(
          res, _rows_scaled(gathered_ct, scales.row_scale), static.precision)
  if has_dw and scales.scale is not None:
    ct_dw = ct_dw * scales.scale.astype(ct_dw.dtype)
  cts = []
  if has_dx:
    cts.append(ct_dx.astype(dx_aval.dtype))
  if has_dw:
    cts.append(ct_dw.astype(dw_aval.dtype))
  return [None] * (2 + sum(static.scales)) + cts


def _rows_scaled(a, row_scale):
  """`a[..., n]` times `row_scale[...]` per row in f32 (or wider), or `a`
  without row scales."""
  if row_scale is None:
    return a
  return ring.scaled(a.astype(ring.accumulation_dtype(a.dtype)),
                     row_scale=row_scale)


def _tangent_jvp(primals, tangents, **params):
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  return jax.jvp(functools.partial(_tangent_eval, **params), tuple(primals),
                 tuple(tangents))


def _tangent_batch(args, dims, **params):
  out = jax.vmap(functools.partial(_tangent_eval, **params),
                 in_axes=tuple(dims))(*args)
  return out, 0


collective_matmul_tangent_p = jex_core.Primitive("collective_matmul_tangent")
collective_matmul_tangent_p.def_impl(_tangent_eval)
collective_matmul_tangent_p.def_abstract_eval(
    lambda *_, out_aval, **__: out_aval)
mlir.register_lowering(collective_matmul_tangent_p,
                       mlir.lower_fun(_tangent_eval, multiple_results=False))
ad.primitive_jvps[collective_matmul_tangent_p] = _tangent_jvp
ad.primitive_transposes[collective_matmul_tangent_p] = _tangent_transpose
batching.primitive_batchers[collective_matmul_tangent_p] = _tangent_batch
