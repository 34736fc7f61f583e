"""The device mesh: ('data', 'tensor') from the ici_* keys."""
from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

from reference_host import config as config_lib


def create_mesh(config: config_lib.Config,
                devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A data x tensor mesh with Auto axes, so logical-axis constraints and
  XLA's propagation place the activations (the linen/MaxText model)."""
  devices = list(jax.devices() if devices is None else devices)
  if not hasattr(config, "data_parallelism") or (
      config.data_parallelism * config.tensor_parallelism != len(devices)):
    config = config_lib.resolve_for_devices(config, len(devices))
  return jax.make_mesh(
      (config.data_parallelism, config.tensor_parallelism),
      config_lib.MESH_AXES,
      axis_types=(AxisType.Auto,) * len(config_lib.MESH_AXES),
      devices=devices)


def logical_axis_rules(config: config_lib.Config) -> tuple:
  """The config's rules as flax expects them: ((logical, mesh_axes), ...)."""
  rules = []
  for logical, mesh_axes in config.logical_axis_rules:
    if isinstance(mesh_axes, list):
      mesh_axes = tuple(mesh_axes)
    rules.append((logical, mesh_axes))
  return tuple(rules)
