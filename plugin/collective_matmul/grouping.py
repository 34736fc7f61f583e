"""Sibling projections of one activation in one collective matmul.

Attention's unfused query, key and value, or the MLP's wi_0 and wi_1, each
multiply the same activation. Rewritten one by one, each is a collective
matmul of its own that sends the activation around the ring again. Given
together to `grouped_logical_dot_general`, when all of them match the same
all-gather pattern, they run as ONE collective matmul over their weights'
local columns concatenated inside the `shard_map` (each device concatenates
its own shards, so no weight moves), and the result is split back. The
backward of that concatenation is one matmul-reduce-scatter over the
concatenated cotangents: autodiff of concatenate/split around the op.

Parameters are untouched: the kernels are concatenated at run time, on their
values. With the plugin off every member is `lax.dot_general` on its own,
exactly as `logical_dot_general` would run it (nothing is concatenated).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax

from collective_matmul import config as config_lib
from collective_matmul import override
from collective_matmul import patterns
from collective_matmul import record
from collective_matmul.enums import Collective


# Why siblings run alone while the configuration switches grouping off.
GROUPING_OFF = ("grouping is switched off "
                f"(--{config_lib.flag_name('group_siblings')})")


class GroupMember(NamedTuple):
  """One projection of the shared activation.

  Attributes:
    kernel: its weight, contracted with the activation as
      `dimension_numbers` says.
    kernel_axes: the weight's logical axis names, e.g. `('embed', 'heads')`.
    name: labels it in the decision record.
  """

  kernel: jax.Array
  kernel_axes: Sequence[str | None]
  name: str | None = None


def grouped_logical_dot_general(lhs, members: Sequence[GroupMember | tuple],
                                dimension_numbers, precision=None,
                                preferred_element_type=None, *,
                                lhs_axes: Sequence[str | None],
                                config: config_lib.CollectiveMatmulConfig
                                | None = None) -> list[jax.Array]:
  """`[lax.dot_general(lhs, m.kernel, dimension_numbers, ...) for m in
  members]`, the all-gathers of `lhs` overlapped in one collective matmul.

  The logical-axes form, like `logical_dot_general`: the mesh is the one set
  with `jax.set_mesh` (or a legacy `with mesh:` block), the axis rules the
  active Flax ones.

  Args:
    lhs: the shared activation, e.g. `[batch, length, embed]`.
    members: `GroupMember`s, or `(kernel, kernel_axes, name)` tuples.
    dimension_numbers: as in `lax.dot_general`, the same for every member
      (e.g. `(((lhs.ndim - 1,), (0,)), ((), ()))` for Dense kernels).
    precision, preferred_element_type: as in `lax.dot_general`.
    lhs_axes: logical names of the activation's dimensions.
    config: use this configuration instead of the active one.

  Returns:
    One result per member, in order. With `group_siblings` on, when every
    member matches the all-gather pattern over the same mesh axis, they come
    from one collective matmul (the record names the group); otherwise each
    member runs as `logical_dot_general` alone, and the record says why
    they were not grouped.
  """
  members = [GroupMember(m[0], tuple(m[1]), m[2] if len(m) > 2 else None)
             for m in members]
  lhs_axes = tuple(lhs_axes)
  cfg = config or config_lib.get_config()

  def alone(member, why=""):
    # Its own name scope, as a Dense layer of that name would give it.
    with jax.named_scope(_short_name(member.name)):
      return override.collective_dot_general(
          lhs, member.kernel, dimension_numbers, precision,
          preferred_element_type, lhs_axes=lhs_axes,
          rhs_axes=member.kernel_axes, name=member.name, config=cfg,
          group_reason=why)

  if not cfg.enabled or len(members) < 2:
    return [alone(m) for m in members]
  if not cfg.group_siblings:
    return [alone(m, GROUPING_OFF) for m in members]
  calls = [override.plan_call(
      lhs, m.kernel, dimension_numbers, precision, preferred_element_type,
      lhs_axes=lhs_axes, rhs_axes=m.kernel_axes, name=m.name, cfg=cfg,
      choose=False) for m in members]
  names = [m.name or f"member {i}" for i, m in enumerate(members)]
  why = _not_groupable_reason(calls, names)
  if why is not None:
    return [alone(m, why) for m in members]
  plan = _group_plan(calls, dimension_numbers, cfg, preferred_element_type)
  group = tuple(m.name for m in members)
  calls = [call.with_plan(plan, group=group) for call in calls]
  for call in calls:
    record.record(call.decision, cfg.strict, call.fallback)
  # One scope names the group's ops ("query+key+value"), so a profile can
  # attribute the shared kernel to its members.
  with jax.named_scope("+".join(_short_name(name) for name in group)):
    return override.rewrite(calls, plan, dimension_numbers, precision,
                            preferred_element_type, cfg.save_gathered)


def _short_name(name: str | None) -> str:
  """'query' for 'layers_0/self_attention/query': a name-scope segment."""
  return (name or "member").rsplit("/", 1)[-1]


def _not_groupable_reason(calls, names) -> str | None:
  """Why these members cannot share one all-gather matmul, or None."""
  first = calls[0]
  for call, name in zip(calls, names):
    if call.match is None:
      return f"{name} is not rewritten ({call.decision.reason})"
    if call.match.collective != Collective.ALL_GATHER:
      return f"{name} is a matmul + reduce-scatter, not an all-gather matmul"
    if call.match.axis != first.match.axis:
      return (f"{name} gathers over {call.match.axis!r}, {names[0]} over "
              f"{first.match.axis!r}")
    if (call.match.lhs_gather_dim, call.match.lhs_spec) != (
        first.match.lhs_gather_dim, first.match.lhs_spec):
      return (f"{name} gathers the activation as {call.match.lhs_spec}, "
              f"{names[0]} as {first.match.lhs_spec}")
  return None


def _group_plan(calls, dimension_numbers, cfg, preferred_element_type):
  """The kernel plan for the group: chosen for the one matmul it runs, the
  activation times the concatenated kernel `[k..., n_1 + ... + n_N]`
  sharded on its columns."""
  first = calls[0]
  (lhs_contract, rhs_contract), _ = dimension_numbers
  mesh_axis_sizes = dict(zip(first.mesh.axis_names, first.mesh.axis_sizes))
  columns = sum(
      math.prod(size for d, size in enumerate(call.rhs.shape)
                if d not in rhs_contract) for call in calls)
  k_dims = tuple(first.rhs.shape[d] for d in rhs_contract)
  rhs = jax.ShapeDtypeStruct(k_dims + (columns,), first.rhs.dtype)
  numbers = ((tuple(lhs_contract), tuple(range(len(k_dims)))), ((), ()))
  rhs_spec = ((),) * len(k_dims) + ((first.match.axis,),)
  match = patterns.match_all_gather_matmul(
      first.lhs.shape, rhs.shape, numbers, first.match.lhs_spec, rhs_spec,
      mesh_axis_sizes)
  assert isinstance(match, patterns.AllGatherMatch), match
  return override.choose_plan(cfg, match, first.lhs, rhs, numbers,
                              first.mesh, preferred_element_type)
