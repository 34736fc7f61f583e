"""Detection of the collective-matmul pattern from shapes and shardings only.

Pure functions of global shapes, dimension numbers, partition specs and mesh
axis sizes, so every process reaches the same answer (a ring in which one
device took another path would hang) and every case is unit-testable
without devices.

The all-gather pattern: lhs has a non-contracting dimension
sharded over mesh axis A, rhs has a non-contracting (output-feature)
dimension sharded over the same A, and no contracting dimension is sharded.
XLA would all-gather lhs over A before the matmul; we overlap the two.

The reduce-scatter pattern: lhs and rhs are both sharded over mesh axis A on
the (same) contracting dimension, and the result is wanted sharded over A on
an lhs non-contracting ("row") dimension. XLA would sum the local products
with a reduce-scatter after the matmul; we overlap the two. Shapes and specs
of the operands cannot say where the sum should end up (all-reduced,
reduce-scattered on rows or on columns, left unreduced), so this pattern
needs the result's spec: `out_sharding` with Explicit axes (JAX 0.10.2
rejects such a `dot_general` without one: "Contracting dimensions are
sharded and it is ambiguous how the output should be sharded"), or the
result's logical axes (`logical_dot_general(..., out_axes=...)`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Mapping, Sequence

from collective_matmul.enums import Collective

Spec = tuple[tuple[str, ...], ...]  # Per dimension: the mesh axes sharding it.


@dataclasses.dataclass(frozen=True)
class AllGatherMatch:
  """Where the all-gather pattern sits in one `dot_general`.

  Attributes:
    collective: all-gather, for every match of this pattern.
    axis: the mesh axis the collective runs over.
    axis_size: its number of devices.
    lhs_gather_dim: the lhs dimension sharded over `axis` (gathered).
    rhs_out_dim: the rhs dimension sharded over `axis` (stays sharded).
    lhs_spec, rhs_spec: the operands' specs (also the shard_map in_specs).
    out_spec: the result's spec: lhs free dims (the gathered one without
      `axis`) then rhs free dims.
    rhs_gathered: mesh axes the weight is all-gathered over before the ring
      (FSDP); `rhs_spec` is its layout after that gather.
  """

  collective: ClassVar[Collective] = Collective.ALL_GATHER
  axis: str
  axis_size: int
  lhs_gather_dim: int
  rhs_out_dim: int
  lhs_spec: Spec
  rhs_spec: Spec
  out_spec: Spec
  rhs_gathered: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ReduceScatterMatch:
  """Where the reduce-scatter pattern sits in one `dot_general`.

  Attributes:
    collective: reduce-scatter, for every match of this pattern.
    axis: the mesh axis the collective runs over.
    axis_size: its number of devices.
    lhs_contract_dim, rhs_contract_dim: the contracting dimensions sharded
      over `axis` (summed over it).
    lhs_scatter_dim: the lhs row dimension whose result is scattered.
    out_scatter_dim: the same dimension's index in the result.
    lhs_spec, rhs_spec: the operands' specs (also the shard_map in_specs).
    out_spec: the result's spec: lhs free dims (the scattered one with
      `axis` added last) then rhs free dims.
    rhs_gathered: mesh axes the weight is all-gathered over before the ring
      (FSDP); `rhs_spec` is its layout after that gather.
  """

  collective: ClassVar[Collective] = Collective.REDUCE_SCATTER
  axis: str
  axis_size: int
  lhs_contract_dim: int
  rhs_contract_dim: int
  lhs_scatter_dim: int
  out_scatter_dim: int
  lhs_spec: Spec
  rhs_spec: Spec
  out_spec: Spec
  rhs_gathered: tuple[str, ...] = ()


Match = AllGatherMatch | ReduceScatterMatch


@dataclasses.dataclass(frozen=True)
class NoMatch:
  """Why a `dot_general` is left to XLA.

  `fallback` is True when the pattern is there but cannot be served (strict
  mode turns that into an error); False when it is simply not the pattern.
  """

  reason: str
  fallback: bool = False


def normalize_spec(spec, ndim: int) -> Spec:
  """A PartitionSpec (or tuple) as one tuple of mesh axes per dimension."""
  entries = tuple(spec) if spec is not None else ()
  if len(entries) > ndim:
    raise ValueError(f"spec {spec} has more entries than the {ndim} dims")
  out = []
  for entry in entries + (None,) * (ndim - len(entries)):
    if entry is None:
      out.append(())
    elif isinstance(entry, str):
      out.append((entry,))
    elif isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
      out.append(entry)
    else:  # P.UNCONSTRAINED and friends: nothing certain to match on.
      raise ValueError(f"unsupported spec entry {entry!r} in {spec}")
  return tuple(out)


def drop_size_one_axes(spec: Spec, mesh_axis_sizes: Mapping[str, int]) -> Spec:
  """`spec` without the mesh axes of size 1: they shard nothing.

  MaxText's logical rules map one name to several mesh axes, most of them of
  size 1 on a given mesh (`mlp -> (fsdp_transpose, tensor, tensor_sequence,
  autoregressive)`); MaxText drops them itself (`remove_size_one_mesh_axis`).
  Axes not in the mesh are kept, so the matcher can name them.
  """
  return tuple(tuple(a for a in axes if mesh_axis_sizes.get(a) != 1)
               for axes in spec)


def _weight_axes_to_gather(lhs_spec: Spec, rhs_spec: Spec,
                           rhs_contract: Sequence[int], axis: str
                           ) -> tuple[str, ...]:
  """The mesh axes other than `axis` that the weight (rhs) is gathered over
  before the ring, as XLA's own FSDP program gathers it per layer.

  Those are the axes sharding an rhs contracting dimension (FSDP shards the
  weight's embed dimension), and those sharding an rhs free dimension that
  also shard the activation (the result cannot be sharded over one axis
  twice). An axis that shards only a weight output dimension is a genuine
  second tensor-parallel axis: it is not gathered (the matcher then says why
  it cannot serve the pattern).
  """
  lhs_axes = {a for axes in lhs_spec for a in axes}
  gathered = [a for d, axes in enumerate(rhs_spec) for a in axes
              if a != axis and (d in rhs_contract or a in lhs_axes)]
  return tuple(dict.fromkeys(gathered))


def _without(spec: Spec, gone: Sequence[str]) -> Spec:
  return tuple(tuple(a for a in axes if a not in gone) for axes in spec)


def spec_to_partition_spec(spec: Spec):
  """The `jax.sharding.PartitionSpec` for a normalized spec."""
  from jax.sharding import PartitionSpec
  return PartitionSpec(*[None if not axes else axes[0] if len(axes) == 1
                         else axes for axes in spec])


def _free_dims(ndim: int, contracting: Sequence[int]) -> list[int]:
  return [d for d in range(ndim) if d not in contracting]


def _opening(dimension_numbers, specs: Spec,
             mesh_axis_sizes: Mapping[str, int]
             ) -> tuple[tuple[int, ...], tuple[int, ...]] | NoMatch:
  """What both patterns check first: no batch dimensions, and every mesh
  axis of `specs` in the mesh. Returns the contracting dimensions
  (lhs, rhs), or the `NoMatch`."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  if lhs_batch or rhs_batch:
    return NoMatch("dot_general has batch dimensions "
                   f"{tuple(lhs_batch)}/{tuple(rhs_batch)}")
  for axes in specs:
    for axis in axes:
      if axis not in mesh_axis_sizes:
        return NoMatch(f"mesh axis {axis!r} of the sharding is not in the "
                       f"mesh {dict(mesh_axis_sizes)}", fallback=True)
  return tuple(lhs_contract), tuple(rhs_contract)


def _indivisible(lhs_shape, rhs_shape, lhs_spec: Spec, rhs_spec: Spec,
                 mesh_axis_sizes: Mapping[str, int]) -> NoMatch | None:
  """The first operand dimension its shards do not divide, as a `NoMatch`,
  or None."""
  for name, shape, spec in (("lhs", lhs_shape, lhs_spec),
                            ("rhs", rhs_shape, rhs_spec)):
    for d, (size, axes) in enumerate(zip(shape, spec)):
      shards = math.prod(mesh_axis_sizes[a] for a in axes)
      if size % shards:
        return NoMatch(f"{name} dimension {d} of size {size} is not "
                       f"divisible by its {shards} shards over {axes}",
                       fallback=True)
  return None


def match_all_gather_matmul(
    lhs_shape: Sequence[int],
    rhs_shape: Sequence[int],
    dimension_numbers,
    lhs_spec: Spec,
    rhs_spec: Spec,
    mesh_axis_sizes: Mapping[str, int],
    out_spec: Spec | None = None,
) -> AllGatherMatch | NoMatch:
  """Decides whether a `dot_general` is the all-gather-LHS pattern.

  Args:
    lhs_shape, rhs_shape: global shapes.
    dimension_numbers: as in `lax.dot_general`.
    lhs_spec, rhs_spec: normalized specs (see `normalize_spec`).
    mesh_axis_sizes: every mesh axis name and its size.
    out_spec: the result layout the caller asked for, if any.

  Returns:
    An `AllGatherMatch`, or a `NoMatch` with the reason.
  """
  opening = _opening(dimension_numbers, lhs_spec + rhs_spec,
                     mesh_axis_sizes)
  if isinstance(opening, NoMatch):
    return opening
  lhs_contract, rhs_contract = opening
  lhs_free = _free_dims(len(lhs_shape), lhs_contract)
  rhs_free = _free_dims(len(rhs_shape), rhs_contract)
  rhs_axes_on_free = {a for d in rhs_free for a in rhs_spec[d]}
  candidates = sorted(
      {a for d in lhs_free for a in lhs_spec[d]} & rhs_axes_on_free)
  candidates = [a for a in candidates if mesh_axis_sizes[a] > 1]
  if not candidates:
    return NoMatch("no mesh axis shards both an lhs row dimension and an rhs "
                   "output dimension")
  if len(candidates) > 1:
    return NoMatch(f"several mesh axes {candidates} shard both an lhs row "
                   "dimension and an rhs output dimension", fallback=True)
  (axis,) = candidates
  rhs_gathered = _weight_axes_to_gather(lhs_spec, rhs_spec, rhs_contract, axis)
  rhs_spec = _without(rhs_spec, rhs_gathered)
  lhs_gather_dim = next(d for d in lhs_free if axis in lhs_spec[d])
  rhs_out_dim = next(d for d in rhs_free if axis in rhs_spec[d])

  for name, spec, contract in (("lhs", lhs_spec, lhs_contract),
                               ("rhs", rhs_spec, rhs_contract)):
    for d in contract:
      if spec[d]:
        return NoMatch(f"{name} contracting dimension {d} is sharded over "
                       f"{spec[d]}", fallback=True)
  if lhs_spec[lhs_gather_dim][-1] != axis:
    return NoMatch(
        f"lhs dimension {lhs_gather_dim} is sharded over "
        f"{lhs_spec[lhs_gather_dim]}: {axis!r} must be the minor (last) axis "
        "for the gathered blocks to be contiguous", fallback=True)
  if rhs_spec[rhs_out_dim] != (axis,):
    return NoMatch(f"rhs dimension {rhs_out_dim} is sharded over "
                   f"{rhs_spec[rhs_out_dim]}; only {axis!r} alone is "
                   "supported", fallback=True)
  for d in rhs_free:
    if d != rhs_out_dim and rhs_spec[d]:
      return NoMatch(f"rhs dimension {d} is also sharded over {rhs_spec[d]}",
                     fallback=True)

  indivisible = _indivisible(lhs_shape, rhs_shape, lhs_spec, rhs_spec,
                             mesh_axis_sizes)
  if indivisible is not None:
    return indivisible

  natural_out = tuple(
      lhs_spec[d][:-1] if d == lhs_gather_dim else lhs_spec[d]
      for d in lhs_free) + tuple(rhs_spec[d] for d in rhs_free)
  if out_spec is not None and tuple(out_spec) != natural_out:
    return NoMatch(f"out_sharding {out_spec} differs from the collective "
                   f"matmul's layout {natural_out}")
  return AllGatherMatch(axis=axis, axis_size=mesh_axis_sizes[axis],
                        lhs_gather_dim=lhs_gather_dim,
                        rhs_out_dim=rhs_out_dim, lhs_spec=tuple(lhs_spec),
                        rhs_spec=tuple(rhs_spec), out_spec=natural_out,
                        rhs_gathered=rhs_gathered)


def match_matmul_reduce_scatter(
    lhs_shape: Sequence[int],
    rhs_shape: Sequence[int],
    dimension_numbers,
    lhs_spec: Spec,
    rhs_spec: Spec,
    mesh_axis_sizes: Mapping[str, int],
    out_spec: Spec | None,
) -> ReduceScatterMatch | NoMatch:
  """Decides whether a `dot_general` is the matmul-reduce-scatter pattern.

  Args:
    lhs_shape, rhs_shape: global shapes.
    dimension_numbers: as in `lax.dot_general`.
    lhs_spec, rhs_spec: normalized specs (see `normalize_spec`).
    mesh_axis_sizes: every mesh axis name and its size.
    out_spec: the normalized result layout the caller asked for; None (not
      known) is never this pattern.

  Returns:
    A `ReduceScatterMatch`, or a `NoMatch` with the reason: `fallback` only
    when the contraction is sharded and the result is asked for sharded on
    rows over the same axis, but something else stops the rewrite.
  """
  opening = _opening(dimension_numbers,
                     lhs_spec + rhs_spec + tuple(out_spec or ()),
                     mesh_axis_sizes)
  if isinstance(opening, NoMatch):
    return opening
  lhs_contract, rhs_contract = opening
  pairs = list(zip(lhs_contract, rhs_contract))
  candidates = sorted(
      {a for l, r in pairs for a in set(lhs_spec[l]) & set(rhs_spec[r])
       if mesh_axis_sizes[a] > 1})
  if not candidates:
    return NoMatch("no mesh axis shards the contracting dimension of both "
                   "lhs and rhs")
  if out_spec is None:
    return NoMatch(
        f"the contraction is sharded over {candidates} but the result's "
        "sharding is not known (pass out_sharding, or out_axes to "
        "logical_dot_general), so it may be wanted all-reduced")
  lhs_free = _free_dims(len(lhs_shape), lhs_contract)
  rhs_free = _free_dims(len(rhs_shape), rhs_contract)
  out_spec = tuple(out_spec)
  if len(out_spec) != len(lhs_free) + len(rhs_free):
    return NoMatch(f"out_sharding {out_spec} has {len(out_spec)} entries for "
                   f"a {len(lhs_free) + len(rhs_free)}-dimensional result")
  out_rows = out_spec[:len(lhs_free)]
  scattered = [a for a in candidates
               if any(a in axes for axes in out_rows)]
  if not scattered:
    where = ("on its columns" if any(a in axes for a in candidates
                                     for axes in out_spec[len(lhs_free):])
             else "replicated (all-reduced) or unreduced")
    return NoMatch(f"the contraction is sharded over {candidates} but the "
                   f"result is asked for {where}: out_sharding {out_spec}")
  if len(candidates) > 1:
    return NoMatch(f"several mesh axes {candidates} shard the contracting "
                   "dimensions of both lhs and rhs", fallback=True)
  (axis,) = candidates
  rhs_gathered = _weight_axes_to_gather(lhs_spec, rhs_spec, rhs_contract, axis)
  rhs_spec = _without(rhs_spec, rhs_gathered)
  lhs_contract_dim, rhs_contract_dim = next(
      (l, r) for l, r in pairs if axis in lhs_spec[l] and axis in rhs_spec[r])
  for l, r in pairs:
    if (l, r) == (lhs_contract_dim, rhs_contract_dim):
      if lhs_spec[l] != (axis,) or rhs_spec[r] != (axis,):
        return NoMatch(
            f"contracting dimensions lhs {l} / rhs {r} are sharded over "
            f"{lhs_spec[l]} / {rhs_spec[r]}; only {axis!r} alone on both is "
            "supported", fallback=True)
    elif lhs_spec[l] or rhs_spec[r]:
      return NoMatch(f"contracting dimensions lhs {l} / rhs {r} are also "
                     f"sharded, over {lhs_spec[l]} / {rhs_spec[r]}",
                     fallback=True)
  out_scatter_dim = next(i for i, axes in enumerate(out_rows) if axis in axes)
  lhs_scatter_dim = lhs_free[out_scatter_dim]
  natural_out = tuple(
      lhs_spec[d] + (axis,) if d == lhs_scatter_dim else lhs_spec[d]
      for d in lhs_free) + tuple(rhs_spec[d] for d in rhs_free)
  used = [a for axes in natural_out for a in axes]
  if len(used) != len(set(used)):
    return NoMatch(f"the operands' free dimensions share mesh axes: the "
                   f"result would be sharded as {natural_out}", fallback=True)
  if out_spec != natural_out:
    return NoMatch(
        f"out_sharding {out_spec} differs from the collective matmul's "
        f"layout {natural_out} (the lhs row dimension's own sharding, then "
        f"{axis!r} last)", fallback=True)
  indivisible = _indivisible(lhs_shape, rhs_shape, lhs_spec, rhs_spec,
                             mesh_axis_sizes)
  if indivisible is not None:
    return indivisible
  row_shards = math.prod(mesh_axis_sizes[a] for a in natural_out[
      out_scatter_dim])
  if lhs_shape[lhs_scatter_dim] % row_shards:
    return NoMatch(
        f"lhs dimension {lhs_scatter_dim} of size "
        f"{lhs_shape[lhs_scatter_dim]} does not split into the "
        f"{row_shards} row blocks of {natural_out[out_scatter_dim]}",
        fallback=True)
  return ReduceScatterMatch(
      axis=axis, axis_size=mesh_axis_sizes[axis],
      lhs_contract_dim=lhs_contract_dim, rhs_contract_dim=rhs_contract_dim,
      lhs_scatter_dim=lhs_scatter_dim, out_scatter_dim=out_scatter_dim,
      lhs_spec=tuple(lhs_spec), rhs_spec=tuple(rhs_spec),
      out_spec=natural_out, rhs_gathered=rhs_gathered)


def contraction_is_sharded(dimension_numbers, lhs_spec: Spec,
                           rhs_spec: Spec) -> bool:
  """Whether any contracting dimension of either operand is sharded (then
  the all-gather pattern cannot apply and the reduce-scatter one may)."""
  (lhs_contract, rhs_contract), _ = dimension_numbers
  return (any(lhs_spec[d] for d in lhs_contract) or
          any(rhs_spec[d] for d in rhs_contract))
