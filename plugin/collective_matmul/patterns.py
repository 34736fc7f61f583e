"""Detection of the collective-matmul pattern from shapes and shardings only.

Pure functions of global shapes, dimension numbers, partition specs and mesh
axis sizes, so every process reaches the same answer (a ring in which one
device took another path would hang) and every case is unit-testable
without devices.

The all-gather pattern (the seed's): lhs has a non-contracting dimension
sharded over mesh axis A, rhs has a non-contracting (output-feature)
dimension sharded over the same A, and no contracting dimension is sharded.
XLA would all-gather lhs over A before the matmul; we overlap the two.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

Spec = tuple[tuple[str, ...], ...]  # Per dimension: the mesh axes sharding it.


@dataclasses.dataclass(frozen=True)
class AllGatherMatch:
  """Where the all-gather pattern sits in one `dot_general`.

  Attributes:
    axis: the mesh axis the collective runs over.
    axis_size: its number of devices.
    lhs_gather_dim: the lhs dimension sharded over `axis` (gathered).
    rhs_out_dim: the rhs dimension sharded over `axis` (stays sharded).
    lhs_spec, rhs_spec: the operands' specs (also the shard_map in_specs).
    out_spec: the result's spec: lhs free dims (the gathered one without
      `axis`) then rhs free dims.
  """

  axis: str
  axis_size: int
  lhs_gather_dim: int
  rhs_out_dim: int
  lhs_spec: Spec
  rhs_spec: Spec
  out_spec: Spec


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


def spec_to_partition_spec(spec: Spec):
  """The `jax.sharding.PartitionSpec` for a normalized spec."""
  from jax.sharding import PartitionSpec
  return PartitionSpec(*[None if not axes else axes[0] if len(axes) == 1
                         else axes for axes in spec])


def _free_dims(ndim: int, contracting: Sequence[int]) -> list[int]:
  return [d for d in range(ndim) if d not in contracting]


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
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  lhs_contract, rhs_contract = tuple(lhs_contract), tuple(rhs_contract)
  if lhs_batch or rhs_batch:
    return NoMatch("dot_general has batch dimensions "
                   f"{tuple(lhs_batch)}/{tuple(rhs_batch)}")
  for axes in lhs_spec + rhs_spec:
    for axis in axes:
      if axis not in mesh_axis_sizes:
        return NoMatch(f"mesh axis {axis!r} of the sharding is not in the "
                       f"mesh {dict(mesh_axis_sizes)}", fallback=True)
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

  for name, shape, spec in (("lhs", lhs_shape, lhs_spec),
                            ("rhs", rhs_shape, rhs_spec)):
    for d, (size, axes) in enumerate(zip(shape, spec)):
      shards = math.prod(mesh_axis_sizes[a] for a in axes)
      if size % shards:
        return NoMatch(f"{name} dimension {d} of size {size} is not divisible "
                       f"by its {shards} shards over {axes}", fallback=True)

  natural_out = tuple(
      lhs_spec[d][:-1] if d == lhs_gather_dim else lhs_spec[d]
      for d in lhs_free) + tuple(rhs_spec[d] for d in rhs_free)
  if out_spec is not None and tuple(out_spec) != natural_out:
    return NoMatch(f"out_sharding {out_spec} differs from the collective "
                   f"matmul's layout {natural_out}")
  return AllGatherMatch(axis=axis, axis_size=mesh_axis_sizes[axis],
                        lhs_gather_dim=lhs_gather_dim,
                        rhs_out_dim=rhs_out_dim, lhs_spec=tuple(lhs_spec),
                        rhs_spec=tuple(rhs_spec), out_spec=natural_out)
