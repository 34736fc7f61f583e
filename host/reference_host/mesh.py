"""The device mesh: MaxText's mesh axes (config.MESH_AXES), each sized by its
ici_*_parallelism key, and the logical axis rules the model is traced with."""
from __future__ import annotations

import math
from typing import Sequence

import flax.linen as nn
import jax
from jax.sharding import AxisType, Mesh, NamedSharding

from reference_host import config as config_lib


def create_mesh(config: config_lib.Config,
                devices: Sequence[jax.Device] | None = None) -> Mesh:
  """One mesh over all of MaxText's axes, size-1 ones included (as MaxText
  builds it), with Auto axes, so logical-axis constraints and XLA's
  propagation place the activations (the linen/MaxText model)."""
  devices = list(jax.devices() if devices is None else devices)
  if not hasattr(config, "mesh_axis_sizes") or (
      math.prod(config.mesh_axis_sizes.values()) != len(devices)):
    config = config_lib.resolve_for_devices(config, len(devices))
  return jax.make_mesh(
      tuple(config.mesh_axis_sizes[axis] for axis in config_lib.MESH_AXES),
      config_lib.MESH_AXES,
      axis_types=(AxisType.Auto,) * len(config_lib.MESH_AXES),
      devices=devices)


def logical_axis_rules(config: config_lib.Config, mesh: Mesh) -> tuple:
  """The config's rules as flax expects them: ((logical, mesh_axes), ...),
  with the mesh axes of size 1 on `mesh` left out.

  A size-1 axis shards nothing (MaxText's `remove_size_one_mesh_axis` drops
  them from its specs too). Left in, MaxText-style rules such as
  ['mlp', ['tensor', 'tensor_sequence']] would give specs naming two axes
  where one does the sharding, which the plugin does not run as one ring;
  left out, a data x tensor run gets exactly the specs of the former
  ('data', 'tensor') mesh. A rule with no axis left maps its logical axis to
  None (unsharded), still claiming it before later rules of the same name.
  """
  sizes = dict(mesh.shape)
  rules = []
  for rule in config.logical_axis_rules:
    axes = tuple(axis for axis in config_lib.rule_mesh_axes(rule)
                 if sizes[axis] > 1)
    rules.append((rule[0], None if not axes else
                  axes[0] if len(axes) == 1 else axes))
  return tuple(rules)


def batch_sharding(mesh: Mesh, rules: tuple) -> NamedSharding:
  """The token batch [batch, length + 1]: batch as the rules shard the
  activations' batch (config.BATCH_AXIS), the rest replicated."""
  return NamedSharding(
      mesh, nn.logical_to_mesh_axes((config_lib.BATCH_AXIS, None), rules))
