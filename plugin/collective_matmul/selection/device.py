"""What the decision reads about the machine: one `DeviceFacts`, read once
per decision from the mesh (or the default backend) and passed to every rule.
"""
from __future__ import annotations

import dataclasses

import jax

from collective_matmul.kernels import configs

# Device kinds with the sm_90a instructions the kernels use (wgmma, TMA).
HOPPER_DEVICE_KINDS = ("H100", "H200", "H800", "H20", "GH200")


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
  """What the decision reads about the machine.

  platform, device_kind, num_cores: of the mesh's devices (an abstract
  mesh's `abstract_device` when it describes them, else the first device).
  process_count, local_device_count: of the running program.
  """

  platform: str
  device_kind: str
  num_cores: int
  process_count: int = 1
  local_device_count: int = 1

  @property
  def is_hopper(self) -> bool:
    return any(kind in self.device_kind for kind in HOPPER_DEVICE_KINDS)


def device_facts(mesh=None) -> DeviceFacts:
  """The facts of `mesh`'s devices (None: the default backend's)."""
  device = getattr(mesh, "abstract_device", None)
  platform = getattr(device, "platform", None) or jax.default_backend()
  kind = (getattr(device, "device_kind", None)
          or jax.devices()[0].device_kind)
  return DeviceFacts(platform=platform, device_kind=kind,
                     num_cores=configs.sm_count(device),
                     process_count=jax.process_count(),
                     local_device_count=jax.local_device_count())
