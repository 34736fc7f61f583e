"""The drop-in `dot_general`: the rewrite engine.

`dot_general` has `lax.dot_general`'s contract. When the active configuration
enables the plugin and the operands form the all-gather pattern (see
`patterns`), it runs the all-gather matmul (`primitives.collective_matmul`,
what `ops.all_gather_matmul` runs) in a `shard_map` over the pattern's mesh
axis; failing that, when they form the reduce-scatter pattern (which needs
the result's sharding: `out_sharding`, or `out_axes` in logical mode), the
matmul + reduce-scatter; otherwise it *is* `lax.dot_general` (same
result, same compiled program). Every call at trace time leaves a
`record.Decision`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from collective_matmul import config as config_lib
from collective_matmul import patterns
from collective_matmul import plan as plan_lib
from collective_matmul import primitives
from collective_matmul import record as record_lib
from collective_matmul import selection
from collective_matmul import shardings
from collective_matmul.enums import Collective
from collective_matmul.plan import KernelPlan
from collective_matmul.record import Decision

def _plain(lhs, rhs, dimension_numbers, precision, preferred_element_type,
           out_sharding, scales=primitives.Scales()):
  """`lax.dot_general`; with scales, its result times them in the result's
  dtype (as Flax's fp8 `dequantize` and Qwix's `dot_general` do after their
  product): the row scales over the lhs's free dimensions, the column
  scales over the rhs's, then the scalar."""
  kwargs = {} if out_sharding is None else {"out_sharding": out_sharding}
  out = lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                        preferred_element_type=preferred_element_type,
                        **kwargs)
  scale, row_scale, col_scale = scales
  if row_scale is not None:
    out = out * row_scale.reshape(
        row_scale.shape + (1,) * (out.ndim - row_scale.ndim)).astype(
            out.dtype)
  if col_scale is not None:
    out = out * col_scale.astype(out.dtype)
  return out if scale is None else out * scale.astype(out.dtype)


def _collective_axis(match, lhs_free) -> int:
  """The dimension of the canonical lhs (`_canonical_lhs`) the collective
  gathers or scatters."""
  if match.collective == Collective.REDUCE_SCATTER:
    return match.out_scatter_dim
  return lhs_free.index(match.lhs_gather_dim)


def choose_plan(cfg, match, lhs, rhs, dimension_numbers, mesh,
                preferred_element_type, rowwise=False) -> KernelPlan:
  """The kernel plan for a matched pattern: `selection.choose` from the
  configuration, the per-shard problem the kernels would see (the lhs's
  local shard as x[free..., k], the local columns of the rhs) and the
  mesh's device facts."""
  (lhs_contract, rhs_contract), _ = dimension_numbers
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  local = lambda shape, spec, d: shape[d] // math.prod(
      sizes[a] for a in spec[d])
  lhs_free = [d for d in range(lhs.ndim) if d not in lhs_contract]
  k = math.prod(local(lhs.shape, match.lhs_spec, d) for d in lhs_contract)
  n = math.prod(local(rhs.shape, match.rhs_spec, d)
                for d in range(rhs.ndim) if d not in rhs_contract)
  x_shape = [local(lhs.shape, match.lhs_spec, d) for d in lhs_free] + [k]
  rows, rows_per_batch = plan_lib.kernel_rows(
      match.collective, x_shape, _collective_axis(match, lhs_free),
      match.axis_size)
  problem = selection.Problem(
      rows, k, n, jnp.dtype(lhs.dtype), match.axis_size,
      None if preferred_element_type is None
      else jnp.dtype(preferred_element_type),
      None if rhs.dtype == lhs.dtype else jnp.dtype(rhs.dtype),
      rows_per_batch, rowwise)
  return selection.choose(
      cfg.impl, match.collective, problem, selection.device_facts(mesh),
      selection.Options(fallback_impl=cfg.fallback_impl,
                        reduce_scatter_kernel=cfg.reduce_scatter_kernel,
                        bidirectional=cfg.bidirectional))


def _canonical_lhs(lhs_block, lhs_contract):
  """`lhs_block` as x[free..., k]: its contracting dims moved last and
  flattened (a no-op for Dense)."""
  lhs_free = [d for d in range(lhs_block.ndim) if d not in lhs_contract]
  x = jnp.transpose(lhs_block, lhs_free + list(lhs_contract))
  return x.reshape(x.shape[:len(lhs_free)] + (-1,))


def _canonical_rhs(rhs_block, rhs_contract):
  """(`rhs_block` as w[k, n], the shape of its free dims): contracting dims
  first and flattened in the order the lhs flattens its own, free dims
  flattened after them."""
  rhs_free = [d for d in range(rhs_block.ndim) if d not in rhs_contract]
  w = jnp.transpose(rhs_block, list(rhs_contract) + rhs_free)
  free_shape = w.shape[len(rhs_contract):]
  return w.reshape(math.prod(w.shape[:len(rhs_contract)]), -1), free_shape


def rewrite(calls: Sequence[CallPlan], kernel_plan: KernelPlan,
            dimension_numbers, precision, preferred_element_type,
            save_gathered: bool, scales=primitives.Scales()
            ) -> list[jax.Array]:
  """Matched `dot_general`s of one activation as ONE collective op in a
  `shard_map`, as `kernel_plan` says: one call as its own pattern; several
  (all-gather matches of the same activation over the same axis) over
  their weights' local columns concatenated inside the `shard_map` (each
  device concatenates its own shards, so no weight moves), split after.
  `scales`: the op's (`primitives.Scales`: the f32 scalar, replicated;
  row scales of the lhs's free dimensions, laid out as its rows; column
  scales of the rhs's free dimensions, laid out as its columns; one call
  only), each or None.

  Returns:
    One result per call, in order.
  """
  first = calls[0]
  match, mode = first.match, first.decision.mode
  (lhs_contract, rhs_contract), _ = dimension_numbers
  lhs_free = [d for d in range(first.lhs.ndim) if d not in lhs_contract]
  if match.collective == Collective.REDUCE_SCATTER and len(calls) > 1:
    raise ValueError("only all-gather matches share one collective matmul")
  if len(calls) > 1 and (scales.row_scale is not None
                         or scales.col_scale is not None):
    raise ValueError("row and column scales are one call's")
  rhs_free = [d for d in range(first.rhs.ndim) if d not in rhs_contract]
  static = primitives.Static(
      match.collective, match.axis, _collective_axis(match, lhs_free),
      kernel_plan, precision, preferred_element_type, save_gathered)

  def body(lhs_block, *blocks):
    rhs_blocks = blocks[:len(calls)]
    scale, row_scale, col_scale = primitives.Scales.of(
        scales.present, blocks[len(calls):])
    x = _canonical_lhs(lhs_block, lhs_contract)
    ws, free_shapes = zip(*(_canonical_rhs(block, rhs_contract)
                            for block in rhs_blocks))
    w = ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=1)
    if col_scale is not None:
      col_scale = col_scale.reshape(-1)
    y = primitives.collective_matmul(x, w, static, scale=scale,
                                     row_scale=row_scale,
                                     col_scale=col_scale)[0]
    parts = ([y] if len(ws) == 1 else
             jnp.split(y, np.cumsum([w.shape[1] for w in ws])[:-1], axis=-1))
    return tuple(part.reshape(part.shape[:-1] + free_shape)
                 for part, free_shape in zip(parts, free_shapes))

  to_p = patterns.spec_to_partition_spec
  lhs, rhss = first.lhs, [call.rhs for call in calls]
  # The scales are laid out as what they scale: the row scales as the lhs's
  # free dimensions, the column scales as the rhs's.
  scale_specs = [to_p(spec) for spec, given in zip(
      ((), tuple(match.lhs_spec[d] for d in lhs_free),
       tuple(match.rhs_spec[d] for d in rhs_free)), scales.present)
                 if given]
  scale_arrays = scales.arrays()
  if mode == "explicit":
    # Explicit types must equal shard_map's in_specs: drop the size-1 axes
    # (no data moves) and gather the weight over the axes the match says.
    lhs = jax.sharding.reshard(lhs, to_p(match.lhs_spec))
    rhss = [jax.sharding.reshard(rhs, to_p(call.match.rhs_spec))
            for rhs, call in zip(rhss, calls)]
    scale_arrays = [jax.sharding.reshard(a, spec)
                    for a, spec in zip(scale_arrays, scale_specs)]
  outs = jax.shard_map(
      body, mesh=first.mesh,
      in_specs=(to_p(match.lhs_spec),
                *(to_p(call.match.rhs_spec) for call in calls),
                *scale_specs),
      out_specs=tuple(to_p(call.match.out_spec) for call in calls),
      check_vma=False)(lhs, *rhss, *scale_arrays)
  return list(outs)


@dataclasses.dataclass(frozen=True)
class CallPlan:
  """What the override will do with one `dot_general`, decided but not yet
  recorded or run: left to XLA (`match` None), or rewritten as `match` says
  with `decision.plan`. `lhs`/`rhs` are the operands as arrays."""

  decision: Decision
  fallback: bool  # A pattern found but not served as asked (strict raises).
  lhs: jax.Array | None = None
  rhs: jax.Array | None = None
  match: patterns.Match | None = None
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None

  def with_plan(self, plan: KernelPlan, **decision) -> CallPlan:
    """This call served by `plan` (its decision says so), with further
    `decision` fields (a group's names)."""
    return dataclasses.replace(
        self, fallback=plan.is_fallback,
        decision=dataclasses.replace(
            self.decision, impl=plan.impl, backward_impl=plan.backward_impl,
            reason=plan.reason, plan=plan, **decision))


def plan_call(lhs, rhs, dimension_numbers, precision, preferred_element_type,
              out_sharding=None, *, lhs_axes=None, rhs_axes=None,
              out_axes=None, name=None, cfg, group_reason="",
              choose=True, rowwise=False) -> CallPlan:
  """The decision for one `dot_general` with the plugin enabled: the
  pattern it matches and (with `choose`) the kernel plan that serves it.
  Without `choose` a match carries no plan yet (`grouping` chooses one for
  the group).

  Raises lax's own TypeError for operands `lax.dot_general` rejects.
  """
  lhs_shape, rhs_shape = tuple(jnp.shape(lhs)), tuple(jnp.shape(rhs))
  mode = "explicit" if lhs_axes is None else "logical"
  dtype, rhs_dtype = jnp.result_type(lhs), jnp.result_type(rhs)
  # The record names a call of one 16- to 64-bit dtype by that dtype.
  label = (selection.dtype_label(dtype, rhs_dtype, preferred_element_type)
           if selection.is_fp8(dtype) or selection.is_fp8(rhs_dtype)
           else str(dtype))
  if rowwise:
    label += " rowwise"
  decide = functools.partial(
      Decision, name=name, lhs_shape=lhs_shape, rhs_shape=rhs_shape,
      dtype=label,
      mode=mode, group_reason=group_reason)

  def left_to_xla(reason, fallback):
    return CallPlan(decide(rewritten=False, impl=None, reason=reason),
                    fallback)

  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  # lax's own checks first (bad dimension numbers raise lax's TypeError),
  # on shapes only: the rewrite must accept exactly what lax accepts.
  jax.eval_shape(functools.partial(
      lax.dot_general, dimension_numbers=dimension_numbers,
      precision=precision, preferred_element_type=preferred_element_type),
      jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
      jax.ShapeDtypeStruct(rhs.shape, rhs.dtype))
  if not all(isinstance(d, int) for d in (*lhs.shape, *rhs.shape)):
    # jax.export's symbolic dimensions: the ring's shard sizes and slice
    # offsets are static.
    return left_to_xla(f"symbolic dimension {lhs.shape}x{rhs.shape} "
                       "(shape polymorphism): the rewrite needs static "
                       "shapes", fallback=False)
  if 0 in lhs.shape or 0 in rhs.shape:
    return left_to_xla(f"empty operand {lhs.shape}x{rhs.shape}",
                       fallback=False)
  excluded = config_lib.excluded_by(cfg, name)
  if excluded is not None:
    return left_to_xla(f"excluded by the configuration ({excluded!r})",
                       fallback=False)
  try:
    specs = (shardings.explicit_specs(lhs, rhs) if mode == "explicit" else
             shardings.logical_specs(lhs, rhs, lhs_axes, rhs_axes))
  except ValueError as e:
    return left_to_xla(f"sharding unreadable: {e}", fallback=True)
  if specs is None:
    return left_to_xla("operands carry no explicit sharding on a common "
                       "Explicit mesh (use logical_dot_general or "
                       "logical_einsum for Auto-sharded models)",
                       fallback=False)
  mesh = shardings.mesh_of(lhs, rhs, mode)
  if mesh is None:
    return left_to_xla("no mesh is set (use jax.set_mesh, or a `with mesh:` "
                       "block)", fallback=True)
  manual = jax.sharding.AxisType.Manual
  if any(t == manual for t in mesh.axis_types):
    return left_to_xla("already inside shard_map (manual mesh axes)",
                       fallback=False)
  try:
    user_out = shardings.out_spec(
        out_sharding, out_axes,
        lhs.ndim + rhs.ndim - 2 * len(dimension_numbers[0][0]))
  except ValueError as e:
    what = "out_sharding" if out_sharding is not None else "out_axes"
    return left_to_xla(f"{what} unreadable: {e}", fallback=False)
  mesh_axis_sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  specs = tuple(patterns.drop_size_one_axes(spec, mesh_axis_sizes)
                for spec in specs)
  if user_out is not None:
    user_out = patterns.drop_size_one_axes(user_out, mesh_axis_sizes)
  match = patterns.match_all_gather_matmul(
      lhs_shape, rhs_shape, dimension_numbers, *specs, mesh_axis_sizes,
      user_out)
  if isinstance(match, patterns.NoMatch):
    all_gather_miss = match
    match = patterns.match_matmul_reduce_scatter(
        lhs_shape, rhs_shape, dimension_numbers, *specs, mesh_axis_sizes,
        user_out)
    if isinstance(match, patterns.NoMatch):
      # Report the miss that says most: the all-gather one when it found
      # that pattern but could not serve it, or when no contraction is
      # sharded (then the reduce-scatter pattern was never in question).
      if (all_gather_miss.fallback or
          not patterns.contraction_is_sharded(dimension_numbers, *specs)):
        match = all_gather_miss
      return left_to_xla(match.reason, match.fallback)
  (lhs_contract, rhs_contract), _ = dimension_numbers
  reason = selection.served_dtype_reason(dtype, rhs_dtype,
                                         preferred_element_type)
  if reason is not None:
    return left_to_xla(reason, fallback=True)
  lhs_k = tuple(lhs_shape[d] for d in lhs_contract)
  rhs_k = tuple(rhs_shape[d] for d in rhs_contract)
  if lhs_k != rhs_k:
    return left_to_xla(f"contraction sizes differ: lhs {lhs_k}, rhs {rhs_k}",
                       fallback=True)
  decision = decide(rewritten=True, impl=None, reason="", axis=match.axis,
                    collective=match.collective,
                    weight_gathered=match.rhs_gathered)
  call = CallPlan(decision, False, lhs, rhs, match, mesh)
  if not choose:
    return call
  return call.with_plan(choose_plan(cfg, match, lhs, rhs, dimension_numbers,
                                    mesh, preferred_element_type, rowwise))


def collective_dot_general(lhs, rhs, dimension_numbers, precision=None,
                           preferred_element_type=None, out_sharding=None, *,
                           lhs_axes=None, rhs_axes=None, out_axes=None,
                           name=None, config=None, group_reason="",
                           scale=None, row_scale=None, col_scale=None):
  """`dot_general` and `logical_dot_general` with every option: the entry
  for integrations that carry the logical axes themselves (einsum, MaxText,
  the fp8 matmuls).

  Args:
    lhs, rhs, dimension_numbers, precision, preferred_element_type,
    out_sharding: as in `lax.dot_general`.
    lhs_axes, rhs_axes, out_axes: logical axis names (as in
      `logical_dot_general`), or None to read explicit shardings.
    name: labels the decision record.
    config: a `CollectiveMatmulConfig` instead of the active one.
    group_reason: why this projection, given with siblings, runs alone.
    scale: None, or a float32 scalar the product is multiplied by (fp8: the
      product of the operands' scales): rewritten, the ops' `scale`,
      applied to the f32 accumulation before the cast; left to XLA (and
      with the plugin off), `lax.dot_general`'s result times the scale in
      the result's dtype, as Flax's fp8 program dequantizes it.
    row_scale, col_scale: None, or float32 arrays shaped as the lhs's free
      (non-contracting) dimensions and as the rhs's (rowwise fp8: Qwix's
      per-row activation and per-column weight scales; no batch
      dimensions): rewritten, the ops' `row_scale` / `col_scale` (entry
      [i, j] of the f32 accumulation times row_scale[i] * col_scale[j]);
      left to XLA (and with the plugin off), `lax.dot_general`'s result
      times them in the result's dtype, as Qwix's `dot_general` does.
  """
  cfg = config or config_lib.get_config()
  result_dtype = (jnp.result_type(lhs) if preferred_element_type is None
                  else preferred_element_type)
  scale = primitives.check_scale(scale, result_dtype)
  (lhs_contract, rhs_contract), (lhs_batch, _) = dimension_numbers
  if (row_scale is not None or col_scale is not None) and lhs_batch:
    raise ValueError(f"row_scale / col_scale with batch dimensions "
                     f"{dimension_numbers}: scales are of a matmul's rows "
                     "and columns")
  lhs_shape, rhs_shape = jnp.shape(lhs), jnp.shape(rhs)
  row_scale, col_scale = primitives.check_vector_scales(
      row_scale, col_scale,
      [n for d, n in enumerate(lhs_shape) if d not in lhs_contract],
      [n for d, n in enumerate(rhs_shape) if d not in rhs_contract],
      result_dtype, Collective.ALL_GATHER,
      operands=f"lhs{tuple(lhs_shape)} and rhs{tuple(rhs_shape)}")
  scales = primitives.Scales(scale, row_scale, col_scale)
  if not cfg.enabled:
    return _plain(lhs, rhs, dimension_numbers, precision,
                  preferred_element_type, out_sharding, scales)
  call = plan_call(lhs, rhs, dimension_numbers, precision,
                   preferred_element_type, out_sharding, lhs_axes=lhs_axes,
                   rhs_axes=rhs_axes, out_axes=out_axes, name=name, cfg=cfg,
                   group_reason=group_reason,
                   rowwise=row_scale is not None or col_scale is not None)
  record_lib.record(call.decision, cfg.strict, call.fallback)
  if call.match is None:
    return _plain(lhs, rhs, dimension_numbers, precision,
                  preferred_element_type, out_sharding, scales)
  [out] = rewrite([call], call.decision.plan, dimension_numbers, precision,
                  preferred_element_type, cfg.save_gathered, scales)
  if out_sharding is not None and call.decision.mode == "explicit":
    out = jax.sharding.reshard(out, out_sharding)
  return out


def dot_general(lhs, rhs, dimension_numbers, precision=None,
                preferred_element_type=None, out_sharding=None, **kwargs):
  """Drop-in `lax.dot_general` that overlaps the all-gather or the
  reduce-scatter with the matmul.

  Usable as `flax.linen.Dense(dot_general=...)`, `DenseGeneral` and
  `flax.nnx.Linear(dot_general=...)`. Sharding is read from the operands'
  types, so this form needs an Explicit mesh (`jax.set_mesh` with
  `AxisType.Explicit`); for Auto-sharded models with logical axis names use
  `logical_dot_general`.

  Args:
    lhs, rhs, dimension_numbers, precision, preferred_element_type,
    out_sharding: as in `lax.dot_general`. A contraction sharded on both
      operands is rewritten only when `out_sharding` asks for the result
      sharded on an lhs row dimension over the same axis.
    **kwargs: `config` (a `CollectiveMatmulConfig` instead of the active one)
      and `name` (labels the decision record).
  """
  unknown = set(kwargs) - {"config", "name"}
  if unknown:
    raise TypeError(f"dot_general got unexpected arguments {sorted(unknown)}")
  return collective_dot_general(lhs, rhs, dimension_numbers, precision,
                                preferred_element_type, out_sharding,
                                **kwargs)


def logical_dot_general(
    lhs_axes: Sequence[str | None], rhs_axes: Sequence[str | None], *,
    out_axes: Sequence[str | None] | None = None, name: str | None = None,
    config: config_lib.CollectiveMatmulConfig | None = None):
  """A `dot_general` for Auto-sharded models that name their axes logically.

  The operands' mesh axes are resolved from these logical axis names through
  the active Flax logical axis rules (`nn.logical_axis_rules`) and the mesh
  set with `jax.set_mesh`.

  Args:
    lhs_axes: logical names of the activation's dimensions, e.g.
      `('activation_batch', 'activation_length', 'activation_embed')`.
    rhs_axes: logical names of the kernel's dimensions, e.g.
      `('embed', 'mlp')`.
    out_axes: logical names of the result's dimensions, e.g.
      `('activation_batch', 'activation_length', 'activation_embed')` for
      the MLP output projection. Needed for the reduce-scatter pattern (the
      operands alone do not say whether the sum is wanted reduce-scattered
      or all-reduced); when given, an all-gather rewrite is done only if it
      produces this layout. The result is not constrained to it otherwise.
    name: labels this layer in the decision record.
    config: use this configuration instead of the active one.
  """
  lhs_axes, rhs_axes = tuple(lhs_axes), tuple(rhs_axes)
  out_axes = None if out_axes is None else tuple(out_axes)

  def bound_dot_general(lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, out_sharding=None):
    return collective_dot_general(
        lhs, rhs, dimension_numbers, precision, preferred_element_type,
        out_sharding, lhs_axes=lhs_axes, rhs_axes=rhs_axes,
        out_axes=out_axes, name=name, config=config)

  bound_dot_general.__name__ = f"logical_dot_general[{name or ''}]"
  return bound_dot_general
