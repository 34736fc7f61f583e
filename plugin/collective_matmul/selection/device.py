"""What the decision reads about the machine: one `DeviceFacts`, read once
per decision from the mesh (or the default backend) and passed to every rule.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os

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
  nccl_version: (major, minor, patch) of the NCCL the job's processes have
    loaded, the lowest over them (`job_nccl_version`); None where unknown.
  """

  platform: str
  device_kind: str
  num_cores: int
  process_count: int = 1
  local_device_count: int = 1
  nccl_version: tuple[int, int, int] | None = None

  @property
  def is_hopper(self) -> bool:
    return any(kind in self.device_kind for kind in HOPPER_DEVICE_KINDS)


def device_facts(mesh=None) -> DeviceFacts:
  """The facts of `mesh`'s devices (None: the default backend's)."""
  device = getattr(mesh, "abstract_device", None)
  platform = getattr(device, "platform", None) or jax.default_backend()
  kind = (getattr(device, "device_kind", None)
          or jax.devices()[0].device_kind)
  processes = jax.process_count()
  return DeviceFacts(platform=platform, device_kind=kind,
                     num_cores=configs.sm_count(device),
                     process_count=processes,
                     local_device_count=jax.local_device_count(),
                     nccl_version=(job_nccl_version() if processes > 1
                                   and platform in ("gpu", "cuda") else None))


def _decode_nccl_version(code: int) -> tuple[int, int, int]:
  """`ncclGetVersion`'s integer as (major, minor, patch): major * 10000 +
  minor * 100 + patch from NCCL 2.9 on, major * 1000 + minor * 100 + patch
  before."""
  if code >= 10000:
    return code // 10000, code // 100 % 100, code % 100
  return code // 1000, code // 100 % 10, code % 100


def _mapped_nccl(maps_path: str = "/proc/self/maps") -> list[str]:
  """The paths of the libnccl copies this process has mapped, in order."""
  paths = []
  try:
    with open(maps_path) as maps:
      for line in maps:
        path = line.rstrip("\n").split(maxsplit=5)[-1]
        if os.path.basename(path).startswith("libnccl.so") and (
            path not in paths):
          paths.append(path)
  except OSError:
    pass
  return paths


def _nccl_version_of(library) -> tuple[int, int, int] | None:
  try:
    version = ctypes.c_int()
    if library.ncclGetVersion(ctypes.byref(version)) != 0:
      return None
  except AttributeError:
    return None
  return _decode_nccl_version(version.value)


@functools.cache
def loaded_nccl_version() -> tuple[int, int, int] | None:
  """(major, minor, patch) of the NCCL library loaded in this process (what
  XLA's collectives and the kernels' peer pointers use, not a package's
  metadata), or None when none is loaded or it cannot be asked.

  Where several copies are mapped (an LD_PRELOAD'ed libnccl beside the one
  JAX loads from its package), the one the dynamic linker resolves
  `ncclGetVersion` to first (the preloaded one, which XLA's references bind
  to); where none resolves so, the lowest.
  """
  versions = []
  for path in _mapped_nccl():
    try:
      versions.append(_nccl_version_of(ctypes.CDLL(path)))
    except OSError:
      versions.append(None)
  known = {version for version in versions if version is not None}
  if not known:
    return None
  if len(known) == 1:
    return known.pop()
  try:
    first = _nccl_version_of(ctypes.CDLL(None))
  except OSError:
    first = None
  return first if first in known else min(known)


# How long a process waits for the others' NCCL versions (they publish
# theirs when they first decide, at the same trace).
NCCL_EXCHANGE_TIMEOUT_MS = 120_000
_NCCL_KEY = "collective_matmul/nccl_version/"


def _encode(version: tuple[int, int, int] | None) -> str:
  return "unknown" if version is None else ".".join(map(str, version))


def _decode(text: str) -> tuple[int, int, int] | None:
  return None if text == "unknown" else tuple(int(x) for x in text.split("."))


@functools.cache
def job_nccl_version() -> tuple[int, int, int] | None:
  """The lowest NCCL version loaded by the job's processes (None if any
  process's is unknown), so that every process decides from the same
  value: each publishes its own in jax.distributed's key-value store and
  reads the others'. A single process: its own."""
  own = loaded_nccl_version()
  if jax.process_count() == 1:
    return own
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client = distributed.global_state.client
  if client is None:
    return None
  client.key_value_set(f"{_NCCL_KEY}{jax.process_index()}", _encode(own))
  versions = []
  for process in range(jax.process_count()):
    try:
      versions.append(_decode(client.blocking_key_value_get(
          f"{_NCCL_KEY}{process}", NCCL_EXCHANGE_TIMEOUT_MS)))
    except jax.errors.JaxRuntimeError:
      # A process that never published (or a store that failed): unknown,
      # which refuses the ring on every process that reads it.
      return None
  if any(version is None for version in versions):
    return None
  return min(versions)
