"""Sibling projections of one activation as one grouped collective matmul.

Attention's query/key/value in self-attention and MlpBlock's wi_0/wi_1 run
as one grouped collective matmul at the first sibling's dot
(`sibling_group`): its call captures the later siblings' calls as MaxText
makes them (`capture_call`), and their dots are then served the group's
results.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax

from collective_matmul import config as config_lib
from collective_matmul import grouping
from collective_matmul.integrations.maxtext import frames
from collective_matmul.integrations.maxtext import projections

# The DenseGeneral attributes of an owner that project the same activation,
# in the order MaxText 0.2.5 calls them: the first one's dot runs the group.
SIBLINGS = {"attention": ("query", "key", "value"), "mlp": ("wi_0", "wi_1")}


@dataclasses.dataclass(frozen=True)
class Captured:
  """One DenseGeneral's call of `_compute_dot_general_nnx`, as MaxText made
  it, and what the adapter makes of it (`dense.not_served_reason`)."""

  inputs: Any
  kernel: Any
  axis: tuple[int, ...]
  contract_ind: tuple[int, ...]
  matmul_precision: Any
  reason: str | None
  projection: projections.Projection | None
  name: str

  @property
  def dimension_numbers(self):
    return (self.axis, self.contract_ind), ((), ())

  def signature(self):
    """What a served call must share with the call the group computed."""
    return (self.dimension_numbers, self.matmul_precision,
            jnp.shape(self.inputs), jnp.result_type(self.inputs),
            jnp.shape(self.kernel), jnp.result_type(self.kernel))


def sibling_group(stack, call: Captured):
  """(result, "") when the innermost DenseGeneral's `call` is served by its
  siblings' group; else (None, why its siblings were not grouped, or "" when
  it has none).

  The first sibling's dot runs the group and keeps the later ones' results
  in the owner's frame; a later sibling's dot takes its result when its
  call is the one the group computed, on the same input.
  """
  dense = stack[-1]
  owner = next((f for f in reversed(stack[:-1]) if f.kind != "dense"), None)
  siblings = _present_siblings(owner)
  attr = frames.attribute_name(owner.module, dense.module) if siblings else None
  if attr not in siblings:
    return None, ""
  if attr in owner.group_results:
    result, planned, group_input = owner.group_results.pop(attr)
    if call.signature() != planned.signature():
      return None, "its dot_general is not the one the group computed"
    if dense.inputs is group_input:
      return result, ""
    # Attention.__call__ (MaxText 0.2.5, pinned by SUPPORTED_MAXTEXT_
    # VERSIONS) passes inputs_q and inputs_kv, here one array, through the
    # same sharding constraint (`_maybe_shard_with_logical(x,
    # input_axis_names)`) straight to the projections: equal values in two
    # tracers.
    if (owner.kind == "attention" and owner.self_attention and
        jnp.shape(dense.inputs) == jnp.shape(group_input) and
        jnp.result_type(dense.inputs) == jnp.result_type(group_input)):
      return result, ""
    return None, "its input is not provably the group's"
  if attr != siblings[0]:
    return None, owner.group_reason
  result, owner.group_reason = _run_sibling_group(owner, dense, siblings,
                                                  call)
  return result, owner.group_reason


def _present_siblings(owner) -> tuple[str, ...]:
  """The owner's sibling DenseGenerals that exist (MaxText drops `value`
  with share_kv_projections, and key/value with share_kv_layer)."""
  if owner is None or owner.kind not in SIBLINGS:
    return ()
  from maxtext.layers import linears  # pylint: disable=g-import-not-at-top
  present = tuple(a for a in SIBLINGS[owner.kind] if isinstance(
      getattr(owner.module, a, None), linears.DenseGeneral))
  return present if len(present) > 1 else ()


def _run_sibling_group(owner, dense, siblings, call: Captured):
  """At the first sibling's dot: (its result, "") from one grouped
  collective matmul, the later siblings' results kept in `owner`; or (None,
  why not)."""
  if not config_lib.get_config().group_siblings:
    return None, grouping.GROUPING_OFF
  if owner.kind == "attention" and not owner.self_attention:
    return None, ("query and key/value project different arrays (not "
                  "self-attention, or a shared key/value)")
  calls = [call]
  for attr in siblings[1:]:
    sibling, why = capture_call(getattr(owner.module, attr), dense.inputs)
    if why is not None:
      return None, f"{owner.kind}/{attr}: {why}"
    if sibling.reason is not None:
      return None, f"{sibling.name} is left to MaxText ({sibling.reason})"
    if (sibling.projection.activation_axes, sibling.dimension_numbers,
        sibling.matmul_precision) != (call.projection.activation_axes,
                                      call.dimension_numbers,
                                      call.matmul_precision):
      return None, f"{sibling.name} contracts another way than {call.name}"
    if (jnp.shape(sibling.inputs), jnp.result_type(sibling.inputs)) != (
        jnp.shape(call.inputs), jnp.result_type(call.inputs)):
      return None, f"{sibling.name} casts the input to another dtype"
    calls.append(sibling)
  results = grouping.grouped_logical_dot_general(
      call.inputs, [(c.kernel, c.projection.kernel_axes, c.name)
                    for c in calls],
      call.dimension_numbers, lax.Precision(call.matmul_precision),
      lhs_axes=call.projection.activation_axes)
  for attr, sibling, result in zip(siblings[1:], calls[1:], results[1:]):
    owner.group_results[attr] = (result, sibling, dense.inputs)
  return results[0], ""


def capture_call(dense_general, inputs):
  """(the `Captured` call MaxText's own `DenseGeneral.__call__` makes on
  `inputs`, None), or (None, why not).

  The sibling's kernel is then exactly what its own call will contract with
  (read, cast and gathered by MaxText's code); the stand-in result of this
  call is discarded, and jit drops it.
  """
  frames.local.captured = captured = []
  try:
    dense_general(inputs)
  except (TypeError, ValueError) as e:
    return None, f"does not take the same input ({e})"
  finally:
    frames.local.captured = None
  if len(captured) != 1:
    return None, f"made {len(captured)} dot_generals, expected 1"
  return captured[0], None
