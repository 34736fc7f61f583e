"""`einsum` entry points: `jnp.einsum`'s contract, collective matmul inside.

Praxis / Paxml (`EinsumOp`, `einsum_tpl`), NVIDIA's fp8 einsum op and Flax
NNX (`Einsum(einsum_op=...)`) inject their matmuls as einsums:

* `einsum`: drop-in `jnp.einsum`; sharding from the operands' types
  (Explicit meshes), as `dot_general` reads it.
* `logical_einsum(lhs_axes, rhs_axes)`: an einsum op for Auto-sharded models
  that name their axes logically (Flax rules), like `logical_dot_general`.
* `mesh_axes_einsum(lhs_axes, rhs_axes)`: the same with mesh axes per
  dimension (Praxis split-dims mappings).

A two-operand einsum that is one contraction (the indices both operands
share are summed, the others are kept, none repeats) is `dot_general(first
operand, second operand)` followed by a transpose into the equation's output
order, and goes through `dot_general`'s decision and rewrite: the first
operand is the activation, the second the weight (unmatched, it stays that
`lax.dot_general` and transpose: the values `jnp.einsum` computes, and its
program where `jnp.einsum` keeps the operands' order). Every other einsum, and
every einsum while the plugin is off, *is* `jnp.einsum` (same result, same
compiled program) and, with the plugin on, leaves a `Decision` saying why.

The equation is mapped here rather than through `jnp.einsum`'s private
`collective_dot_general` hook: the hook receives the operands as `jnp.einsum`
rearranged them (weight first when that saves a transpose, size-1 dimensions
squeezed), so axes bound to the equation's operands would not line up and a
weight-first call would gather the weight.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np
import opt_einsum

from collective_matmul import config as config_lib
from collective_matmul import override
from collective_matmul import record

# Per dimension: a logical name (or, for `mesh_axes_einsum`, a mesh axis or a
# tuple of mesh axes), or None for unsharded.
Axes = Sequence[str | Sequence[str] | None]


@dataclasses.dataclass(frozen=True)
class _Contraction:
  """A two-operand einsum as `dot_general(lhs, rhs)` plus a transpose."""

  dimension_numbers: tuple
  dot_indices: str  # The dot_general result's: lhs free, then rhs free.
  out_indices: str  # The einsum result's.

  @property
  def permutation(self) -> tuple[int, ...]:
    return tuple(self.dot_indices.index(c) for c in self.out_indices)

  def in_dot_order(self, per_out_dim: Sequence) -> tuple:
    """Entries given per einsum result dimension, per dot_general one."""
    return tuple(per_out_dim[self.out_indices.index(c)]
                 for c in self.dot_indices)


def _as_contraction(inputs: str, output: str,
                    shapes: Sequence[tuple[int, ...]]) -> _Contraction | str:
  """`inputs->output` (ellipses spelled out) as one `dot_general`, or why
  it is not one."""
  terms = inputs.split(",")
  if len(terms) != 2:
    return (f"{len(terms)} operand(s): only a two-operand einsum is a "
            "matmul")
  lhs, rhs = terms
  for i, term in enumerate(terms):
    repeated = "".join(sorted({c for c in term if term.count(c) > 1}))
    if repeated:
      return f"operand {i} repeats index {repeated!r} (a diagonal)"
  shared = [c for c in lhs if c in rhs]
  for c in shared:
    lhs_size, rhs_size = shapes[0][lhs.index(c)], shapes[1][rhs.index(c)]
    if lhs_size != rhs_size:
      return (f"index {c!r} has size {lhs_size} in operand 0 and {rhs_size} "
              "in operand 1 (broadcast)")
  batch = "".join(c for c in shared if c in output)
  if batch:
    return (f"index {batch!r} is in both operands and the result (a batch "
            "dimension)")
  summed = "".join(c for c in lhs + rhs if c not in shared and c not in output)
  if summed:
    return f"index {summed!r} of one operand only is summed over"
  if not shared:
    return "no index is contracted (an outer product)"
  dimension_numbers = ((tuple(lhs.index(c) for c in shared),
                        tuple(rhs.index(c) for c in shared)), ((), ()))
  dot_indices = ("".join(c for c in lhs if c not in shared) +
                 "".join(c for c in rhs if c not in shared))
  return _Contraction(dimension_numbers, dot_indices, output)


def _sharding_in_dot_order(out_sharding, contraction: _Contraction):
  """`out_sharding` (NamedSharding or PartitionSpec, per einsum result
  dimension) for the dot_general's result."""
  spec = getattr(out_sharding, "spec", out_sharding)
  ndim = len(contraction.out_indices)
  partitions = tuple(spec) + (None,) * (ndim - len(spec))
  spec = spec.update(partitions=contraction.in_dot_order(partitions))
  if isinstance(out_sharding, NamedSharding):
    return out_sharding.update(spec=spec)
  return spec


def _einsum(subscripts, operands, *, out, optimize, precision,
            preferred_element_type, out_sharding, lhs_axes, rhs_axes,
            out_axes, axis_rules, name, config):
  """`jnp.einsum`, with a matched contraction rewritten by
  `override.collective_dot_general`.

  `lhs_axes`/`rhs_axes`/`out_axes`: logical names (None: Explicit mode);
  `axis_rules`: Flax rules to resolve them with instead of the active ones.
  """
  cfg = config or config_lib.get_config()
  via_jnp = functools.partial(
      jnp.einsum, subscripts, *operands, out=out, optimize=optimize,
      precision=precision, preferred_element_type=preferred_element_type,
      out_sharding=out_sharding)
  if not cfg.enabled or out is not None:
    return via_jnp()  # (`out`: jnp.einsum's NotImplementedError.)
  mode = "explicit" if lhs_axes is None else "logical"

  def left_to_jnp(label, arrays, reason):
    result = via_jnp()  # jnp.einsum's result, or its error.
    shapes = [tuple(np.shape(a)) for a in arrays]
    record.record_not_served(
        label, f"jnp.einsum as is: {reason}",
        lhs_shape=shapes[0] if shapes else (),
        rhs_shape=shapes[1] if len(shapes) > 1 else (),
        dtype=result.dtype, mode=mode)
    return result

  operands = tuple(_without_jax_array_protocol(op) for op in operands)
  try:
    inputs, output, arrays = opt_einsum.parser.parse_einsum_input(
        (subscripts, *operands))
  except (ValueError, TypeError, IndexError, KeyError):
    return via_jnp()  # An invalid einsum: jnp.einsum's own error.
  label = name or "einsum({!r})".format(
      subscripts if isinstance(subscripts, str) else f"{inputs}->{output}")
  if not all(isinstance(a, (jax.Array, np.ndarray)) for a in arrays):
    return left_to_jnp(label, arrays, "an operand is not an array")
  if out_sharding is not None and not isinstance(
      out_sharding, (NamedSharding, PartitionSpec)):
    return via_jnp()  # jnp.einsum's NotImplementedError.
  contraction = _as_contraction(inputs, output,
                                [tuple(np.shape(a)) for a in arrays])
  if isinstance(contraction, str):
    return left_to_jnp(label, arrays, contraction)
  if out_sharding is not None and len(
      getattr(out_sharding, "spec", out_sharding)) > len(output):
    return via_jnp()  # jnp.einsum's error for a spec longer than the result.

  lhs, rhs = arrays
  dot_out_axes = out_axes
  if out_axes is not None and len(out_axes) == len(output):
    # (Of another length: passed as they are, for collective_dot_general
    # to name.)
    dot_out_axes = contraction.in_dot_order(out_axes)
  rules = (contextlib.nullcontext() if axis_rules is None else
           _flax().logical_axis_rules(axis_rules))
  with rules:
    result = override.collective_dot_general(
        lhs, rhs, contraction.dimension_numbers, precision,
        preferred_element_type,
        (None if out_sharding is None
         else _sharding_in_dot_order(out_sharding, contraction)),
        lhs_axes=lhs_axes, rhs_axes=rhs_axes, out_axes=dot_out_axes,
        name=label, config=cfg)
  if contraction.permutation != tuple(range(result.ndim)):
    result = lax.transpose(result, contraction.permutation)
  dtype = (jnp.dtype(preferred_element_type)
           if preferred_element_type is not None
           else jnp.result_type(lhs, rhs))
  return result if result.dtype == dtype else result.astype(dtype)


def _without_jax_array_protocol(operand):
  """The array behind an `__jax_array__` object (as `jnp.einsum` takes it)."""
  convert = getattr(operand, "__jax_array__", None)
  return operand if convert is None else convert()


def _flax():
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  return nn


def einsum(subscripts, /, *operands, out=None, optimize="auto",
           precision=None, preferred_element_type=None, out_sharding=None,
           name: str | None = None,
           config: config_lib.CollectiveMatmulConfig | None = None):
  """Drop-in `jnp.einsum` that overlaps the all-gather or the reduce-scatter
  with the matmul.

  Usable as `flax.nnx.Einsum(einsum_op=...)` and wherever an einsum callable
  is injected. Sharding is read from the operands' types, so this form needs
  an Explicit mesh (`jax.set_mesh` with `AxisType.Explicit`); for
  Auto-sharded models use `logical_einsum` or `mesh_axes_einsum`.

  Args:
    subscripts, *operands, out, optimize, precision, preferred_element_type,
    out_sharding: as in `jnp.einsum`. A two-operand contraction is rewritten
      when its first operand (the activation) and second (the weight) form
      the pattern `dot_general` rewrites; a contraction sharded on both
      operands only when `out_sharding` asks for the result sharded on an
      activation dimension over the same mesh axis.
    name: labels the decision record (default: the equation).
    config: a `CollectiveMatmulConfig` to use instead of the active one.
  """
  return _einsum(subscripts, operands, out=out, optimize=optimize,
                 precision=precision,
                 preferred_element_type=preferred_element_type,
                 out_sharding=out_sharding, lhs_axes=None, rhs_axes=None,
                 out_axes=None, axis_rules=None, name=name, config=config)


@dataclasses.dataclass(frozen=True)
class BoundEinsum:
  """An einsum op with its operands' sharding bound: call it as
  `jnp.einsum` (Praxis `EinsumOp`: `op(equation, *operands)`).

  Made by `logical_einsum` and `mesh_axes_einsum`; immutable and hashable,
  so it can be a static attribute of a Flax module.
  """

  lhs_axes: tuple
  rhs_axes: tuple
  out_axes: tuple | None
  axis_rules: tuple | None  # Flax rules resolving the axes; None: active.
  name: str | None
  config: config_lib.CollectiveMatmulConfig | None

  def __call__(self, subscripts, /, *operands, out=None, optimize="auto",
               precision=None, preferred_element_type=None,
               out_sharding=None):
    return _einsum(subscripts, operands, out=out, optimize=optimize,
                   precision=precision,
                   preferred_element_type=preferred_element_type,
                   out_sharding=out_sharding, lhs_axes=self.lhs_axes,
                   rhs_axes=self.rhs_axes, out_axes=self.out_axes,
                   axis_rules=self.axis_rules, name=self.name,
                   config=self.config)


def logical_einsum(lhs_axes: Sequence[str | None],
                   rhs_axes: Sequence[str | None], *,
                   out_axes: Sequence[str | None] | None = None,
                   name: str | None = None,
                   config: config_lib.CollectiveMatmulConfig | None = None
                   ) -> BoundEinsum:
  """An einsum op for Auto-sharded models that name their axes logically.

  The operands' mesh axes are resolved from these logical names through the
  active Flax logical axis rules (`nn.logical_axis_rules`), on the mesh set
  with `jax.set_mesh` or entered with a legacy `with mesh:` block.

    >>> op = cm.logical_einsum(("batch", "seq", "embed"), ("embed", "mlp"))
    >>> y = op("bsd,df->bsf", x, kernel)   # or nnx.Einsum(..., einsum_op=op)

  Args:
    lhs_axes: logical names of the first operand's (the activation's)
      dimensions, e.g. `('activation_batch', 'activation_length',
      'activation_embed')`.
    rhs_axes: logical names of the second operand's (the weight's)
      dimensions, e.g. `('embed', 'mlp')`.
    out_axes: logical names of the einsum result's dimensions, in the
      equation's output order. Needed for the reduce-scatter pattern (e.g.
      an output projection); when given, an all-gather rewrite is done only
      if it produces this layout. The result is not constrained to it.
    name: labels this op in the decision record (default: the equation).
    config: use this configuration instead of the active one.
  """
  return BoundEinsum(
      lhs_axes=_logical_names(lhs_axes, "lhs_axes"),
      rhs_axes=_logical_names(rhs_axes, "rhs_axes"),
      out_axes=(None if out_axes is None
                else _logical_names(out_axes, "out_axes")),
      axis_rules=None, name=name, config=config)


def mesh_axes_einsum(lhs_axes: Axes, rhs_axes: Axes, *,
                     out_axes: Axes | None = None, name: str | None = None,
                     config: config_lib.CollectiveMatmulConfig | None = None
                     ) -> BoundEinsum:
  """An einsum op for Auto-sharded models that give mesh axes per dimension
  (Praxis `weight_split_dims_mapping` / `activation_split_dims_mapping`).

  The mesh is the one set with `jax.set_mesh` or entered with a legacy
  `with mesh:` block (Paxml). Each dimension's entry is None (unsharded), a
  mesh axis name, or a tuple of them (major to minor).

    >>> op = cm.mesh_axes_einsum((("data",), "tensor", None), (None, "tensor"))
    >>> y = op("...y,yz->...z", x, w)      # as praxis Linear calls einsum

  Args:
    lhs_axes: mesh axes of the first operand's (the activation's)
      dimensions, e.g. `('data', 'tensor', None)` for [batch, seq, embed]
      sharded on batch over data and on sequence over tensor.
    rhs_axes: mesh axes of the second operand's (the weight's) dimensions,
      e.g. `(None, 'tensor')`.
    out_axes: mesh axes of the einsum result's dimensions, in the equation's
      output order; needed for the reduce-scatter pattern (as in
      `logical_einsum`).
    name: labels this op in the decision record (default: the equation).
    config: use this configuration instead of the active one.

  Raises:
    ValueError: an entry is not None, a mesh axis name or a tuple of them,
      or one mesh axis shards two dimensions of one operand (names both).
  """
  specs = {"lhs_axes": lhs_axes, "rhs_axes": rhs_axes}
  if out_axes is not None:
    specs["out_axes"] = out_axes
  # Each sharded dimension gets a logical name resolved by one rule to its
  # mesh axes: `collective_dot_general` reads caller-given sharding as
  # logical names.
  names, rules = {}, {}
  for what, spec in specs.items():
    names[what] = []
    for axes in _mesh_axes(spec, what):
      logical = None if axes is None else "+".join(axes)
      if logical is not None:
        rules[logical] = axes[0] if len(axes) == 1 else axes
      names[what].append(logical)
  return BoundEinsum(
      lhs_axes=tuple(names["lhs_axes"]), rhs_axes=tuple(names["rhs_axes"]),
      out_axes=(tuple(names["out_axes"]) if out_axes is not None else None),
      axis_rules=tuple(rules.items()), name=name, config=config)


def _per_dimension(axes, what) -> tuple:
  """`axes` (a sequence, e.g. a tuple, list or PartitionSpec) as a tuple."""
  if not isinstance(axes, str):
    try:
      return tuple(axes)
    except TypeError:
      pass
  raise ValueError(f"{what}={axes!r} must be a sequence with one entry per "
                   "dimension")


def _logical_names(axes, what) -> tuple[str | None, ...]:
  axes = _per_dimension(axes, what)
  for name in axes:
    if name is not None and not isinstance(name, str):
      raise ValueError(f"{what}={axes!r}: {name!r} is not a logical axis "
                       "name or None")
  return axes


def _mesh_axes(spec, what) -> list[tuple[str, ...] | None]:
  """A split-dims mapping as one tuple of mesh axes (or None) per dim."""
  spec = _per_dimension(spec, what)
  out, seen = [], {}
  for dim, entry in enumerate(spec):
    if entry is None:
      axes = ()
    elif isinstance(entry, str):
      axes = (entry,)
    elif (isinstance(entry, (tuple, list)) and
          all(isinstance(a, str) for a in entry)):
      axes = tuple(entry)
    else:
      raise ValueError(f"{what}={spec!r}: entry {entry!r} of "
                       f"dimension {dim} is not None, a mesh axis name or a "
                       "tuple of them")
    for axis in axes:
      if axis in seen:
        raise ValueError(f"{what}={spec!r}: mesh axis {axis!r} "
                         f"shards dimensions {seen[axis]} and {dim}")
      seen[axis] = dim
    out.append(axes or None)
  return out
