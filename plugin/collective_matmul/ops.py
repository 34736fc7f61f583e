"""Differentiable collective matmuls, one entry point per collective.

Call these inside `shard_map` (over at least `axis_name`). What runs is a
`plan.KernelPlan`, carried as the ops' one static argument: the drop-in
`dot_general` passes the plan it chose and recorded; a direct call without
one gets it from `selection.choose`, once, at the public op, from its
`impl` argument (`pallas`: the Hopper kernel, `ring`: the portable
`ppermute` ring, `baseline`: the XLA collective, then one dot). Below the
public ops nothing decides again: the kernels receive the plan's configs.

The two collectives are each other's transpose, so each one's backward runs
the other with the same `impl`: for y = all_gather(x) @ w,
dx = reduce_scatter(dy @ w.T); for y = reduce_scatter(x @ w),
dx = all_gather(dy) @ w.T. Both weight gradients need a gathered operand
(all_gather(x).T @ dy and x.T @ all_gather(dy)); `save_gathered` says whether
the one the collective matmul already assembled is kept for that (memory) or
gathered again (time).

Both ops are `primitives.collective_matmul`, so every JAX transformation
composes through them: `grad` (the other collective in the backward),
`jvp`/`jacfwd`/`linearize` (the same collective on the tangents), `vmap`,
`hessian`, `checkpoint`.
"""
from __future__ import annotations

import dataclasses

from jax import lax
import jax.numpy as jnp

from collective_matmul import plan as plan_lib
from collective_matmul import primitives
from collective_matmul import selection
from collective_matmul.enums import Collective
from collective_matmul.enums import Impl

# What the ops run (`auto` is the override's, resolved by `selection`).
OP_IMPLS = (Impl.PALLAS, Impl.RING, Impl.BASELINE)


def _check_operands(x, w, axis, axis_arg):
  """Validates a collective op's local operands (`axis` is `axis_arg`'s
  value)."""
  if x.ndim < 2 or w.ndim != 2:
    raise ValueError(f"expected x[..., k] with ndim >= 2 and w[k, n], got "
                     f"x{x.shape} and w{w.shape}")
  if x.shape[-1] != w.shape[0]:
    raise ValueError(f"contraction sizes differ: x{x.shape} has k="
                     f"{x.shape[-1]}, w{w.shape} has k={w.shape[0]}")
  if not 0 <= axis < x.ndim - 1:
    raise ValueError(f"{axis_arg}={axis} must index one of the "
                     f"{x.ndim - 1} leading dimensions of x{x.shape}")


def _plan(collective: Collective, x, w, axis, axis_name, impl,
          kernel_config, bidirectional, backward_impl, preferred_element_type,
          plan, rowwise=False):
  """The plan a public op runs: the caller's `plan`, else `selection.choose`
  for these operands from `impl` (and `kernel_config`, `bidirectional`,
  `backward_impl`)."""
  if plan is not None:
    if not isinstance(plan, plan_lib.KernelPlan):
      raise TypeError(f"plan must be a plan.KernelPlan, got {plan!r}")
    if (impl, kernel_config, bidirectional, backward_impl) != (
        None, None, None, None):
      raise TypeError("give either plan or impl/kernel_config/"
                      "bidirectional/backward_impl, not both")
    return plan
  impl = Impl.parse(Impl.RING if impl is None else impl, "impl", OP_IMPLS)
  backward_impl = (None if backward_impl is None else
                   Impl.parse(backward_impl, "backward_impl", OP_IMPLS))
  axis_size = lax.axis_size(axis_name)
  rows, rows_per_batch = plan_lib.kernel_rows(collective, x.shape, axis,
                                              axis_size)
  problem = selection.Problem(
      max(1, rows), max(1, x.shape[-1]), max(1, w.shape[-1]),
      jnp.dtype(x.dtype), axis_size,
      None if preferred_element_type is None
      else jnp.dtype(preferred_element_type),
      None if w.dtype == x.dtype else jnp.dtype(w.dtype), rows_per_batch,
      rowwise)
  device = selection.device_facts()
  options = selection.Options(
      bidirectional=True if bidirectional is None else bidirectional)
  chosen = selection.choose(impl, collective, problem, device, options,
                            config=kernel_config)
  if chosen.is_fallback:
    raise ValueError(
        "impl='pallas' runs the Hopper (sm_90a: H100, H200) kernel on "
        "bf16 or f16 operands, or fp8 (e4m3 x e4m3, e5m2 x e4m3) with a "
        "bf16 or f32 result; here: "
        f"{chosen.reason.removeprefix('pallas unavailable: ')}. Use "
        "impl='ring' (any backend) or 'baseline'.")
  if backward_impl is None or backward_impl == chosen.backward_impl:
    return chosen
  if backward_impl != Impl.PALLAS:
    return dataclasses.replace(chosen, backward_impl=backward_impl,
                               backward_config=options.config(backward_impl),
                               backward_source="")
  back = selection.choose(Impl.PALLAS, collective.transpose,
                          problem.backward(), device)
  if back.is_fallback:
    raise ValueError(f"backward_impl='pallas' cannot run here: "
                     f"{back.reason}")
  return dataclasses.replace(chosen, backward_impl=Impl.PALLAS,
                             backward_config=back.config,
                             backward_source=back.source,
                             backward_row_layout=back.row_layout,
                             backward_weight_layout=back.weight_layout)


_PLAN_ARGS_DOC = """
    impl: `pallas` (Hopper kernel), `ring` (portable, the default) or
      `baseline`; with `pallas` the backward takes the kernel where it runs
      and pays off, else XLA's (`selection.choose`).
    kernel_config: a kernel config for `pallas`, or None to pick one for
      the shape (`selection.config_for`).
    backward_impl: implementation of the backward's collective matmul, or
      None for `impl`'s choice.
    plan: a `plan.KernelPlan` (what the drop-in `dot_general` chose),
      instead of `impl`, `kernel_config`, `bidirectional` and
      `backward_impl`.
    scale: None, or a float32 scalar (shape `()`, the same on every device
      of the axis: one typed as varying over it is refused, one that varies
      unchecked, `check_vma=False`, makes the ring and the baseline
      disagree) that the product's float32 accumulation is multiplied by
      before it is cast to the result's dtype, which must be a float (fp8:
      the product of the operands' per-tensor scales; the kernels apply it
      in their epilogue). Differentiable: the gradients of x and w are scaled by
      it, and its own derivative is the unscaled product, computed again
      (in the result's dtype) only where the scale's gradient is taken.
    row_scale, col_scale: None, or float32 vectors: one per row of the
      local `x` (shape `x.shape[:-1]`) and one per column of the local `w`
      (`[n]`); entry `[i, j]` of the float32 accumulation is multiplied by
      `row_scale[i] * col_scale[j]` (and `scale`) before the cast
      (rowwise fp8: Qwix's per-row activation and per-column weight
      scales). Their values are used as given (a zero zeroes its row or
      column, a NaN makes it NaN). The all-gather carries each shard's row
      scales with its rows; for the matmul + reduce-scatter both are the
      same on every device (one typed as varying over the axis is
      refused). The Hopper kernels apply them in their epilogue with fp8
      operands; with others (`selection.scales_reason`) `pallas` refuses
      them and `auto` runs XLA's GEMM on Hopper. Differentiable in x and
      w (their gradients scaled correspondingly); the scales are constants
      of differentiation (zero gradient, no tangent), as Qwix's
      `dot_general_qt` treats its scales."""


def all_gather_matmul(x, w, axis_name, *, gather_axis: int = 0,
                      impl: Impl | str | None = None,
                      bidirectional: bool | None = None,
                      precision=None, preferred_element_type=None,
                      kernel_config=None, save_gathered: bool = True,
                      backward_impl: Impl | str | None = None,
                      plan: plan_lib.KernelPlan | None = None,
                      scale=None, row_scale=None, col_scale=None):
  """`all_gather(x, axis_name, axis=gather_axis, tiled=True) @ w`, overlapped
  (times the scales).

  Use inside `shard_map`. Differentiable (`jax.grad` gives the same dx and
  dw as through the baseline). The backward computes
  dx = reduce_scatter(dy @ w.T) with `matmul_reduce_scatter`.

  Args:
    x: local activation shard `[..., k]`; `gather_axis` is the leading
      dimension sharded over `axis_name` (batch, sequence or rows).
    w: local weight columns `[k, n]`.
    axis_name: the mesh axis to gather over.
    gather_axis: which dimension of `x` is gathered.
    bidirectional: for `ring` with more than two devices, send both ways
      (None: yes); the plan's `ring.RingConfig`.
    precision, preferred_element_type: as in `lax.dot_general`.
    save_gathered: (default, as in `CollectiveMatmulConfig`) keep the
      gathered activation `all_gather(x)` from the forward for the weight
      gradient: D x the activation shard's memory,
      held until the backward (`pallas` keeps the shards its ring received;
      the other impls gather them). False: the backward gathers `x` again
      (one more all-gather's time).{plan_args}

  Returns:
    `[..., n]` with `gather_axis` D times longer, blocks in axis-index order.
  """
  return _collective_op(
      Collective.ALL_GATHER, x, w, axis_name, gather_axis, "gather_axis",
      impl, bidirectional, precision, preferred_element_type, kernel_config,
      save_gathered, backward_impl, plan,
      primitives.Scales(scale, row_scale, col_scale))


def matmul_reduce_scatter(x, w, axis_name, *, scatter_axis: int = 0,
                          impl: Impl | str | None = None,
                          bidirectional: bool | None = None,
                          precision=None, preferred_element_type=None,
                          kernel_config=None, save_gathered: bool = True,
                          backward_impl: Impl | str | None = None,
                          plan: plan_lib.KernelPlan | None = None,
                          scale=None, row_scale=None, col_scale=None):
  """`psum_scatter(x @ w, axis_name, scatter_dimension=scatter_axis,
  tiled=True)`, overlapped (times the scales).

  Use inside `shard_map`. Differentiable (`jax.grad` gives the same dx and
  dw as through the baseline). The backward computes
  dx = all_gather(dy) @ w.T with `all_gather_matmul`'s implementation.

  Args:
    x: local activation `[..., k]`: every row, and this device's slice of
      the contraction (e.g. the MLP's hidden features).
    w: local weight rows `[k, n]`: the same slice of the contraction.
    axis_name: the mesh axis the contraction is sharded over and the result
      is scattered over.
    scatter_axis: the leading dimension of `x` the result is scattered on
      (batch, sequence or rows); its size must divide by the axis size.
    bidirectional: for `ring` with more than two devices, sum from both
      sides at once, halving the sequential steps (None: yes); the plan's
      `ring.RingConfig`.
    precision, preferred_element_type: as in `lax.dot_general`. `ring` sums
      the D partial products in float32 (or the wider
      `preferred_element_type`) and casts once at the end; `baseline` and
      `pallas` sum in the product's dtype, as XLA's reduce-scatter does
      (with `scale`, each partial product scaled before it is cast).
    save_gathered: (default, as in `CollectiveMatmulConfig`) in the
      backward, use the gathered cotangent that the dx all-gather matmul
      assembles for dw too (D x the cotangent shard's
      memory while dw is computed). False: gather dy again for dw (one more
      all-gather's time).{plan_args}

  Returns:
    `[..., n]` with `scatter_axis` D times shorter: row block d of the sum
    over the axis, on device d.
  """
  return _collective_op(
      Collective.REDUCE_SCATTER, x, w, axis_name, scatter_axis,
      "scatter_axis", impl, bidirectional, precision, preferred_element_type,
      kernel_config, save_gathered, backward_impl, plan,
      primitives.Scales(scale, row_scale, col_scale))


def _collective_op(collective: Collective, x, w, axis_name, axis, axis_arg,
                   impl, bidirectional, precision, preferred_element_type,
                   kernel_config, save_gathered, backward_impl, plan,
                   scales: primitives.Scales):
  """A public op: its operands and scales checked, its plan, its
  primitive."""
  _check_operands(x, w, axis, axis_arg)
  result_dtype = (x.dtype if preferred_element_type is None
                  else preferred_element_type)
  scale = primitives.check_scale(scales.scale, result_dtype, axis_name)
  row_scale, col_scale = primitives.check_vector_scales(
      scales.row_scale, scales.col_scale, x.shape[:-1], w.shape[1:],
      result_dtype, collective, axis_name,
      operands=f"x{tuple(x.shape)} and w{tuple(w.shape)}")
  plan = _plan(collective, x, w, axis, axis_name, impl, kernel_config,
               bidirectional, backward_impl, preferred_element_type, plan,
               rowwise=row_scale is not None or col_scale is not None)
  return primitives.collective_matmul(x, w, primitives.Static(
      collective, axis_name, axis, plan, precision, preferred_element_type,
      save_gathered), scale=scale, row_scale=row_scale,
      col_scale=col_scale)[0]


all_gather_matmul.__doc__ = all_gather_matmul.__doc__.format(
    plan_args=_PLAN_ARGS_DOC)
matmul_reduce_scatter.__doc__ = matmul_reduce_scatter.__doc__.format(
    plan_args=_PLAN_ARGS_DOC)
