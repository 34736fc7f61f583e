"""What the GPU suite can run on here."""
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import jax


def _hopper_count():
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    return 0
  return sum(any(k in d.device_kind for k in ("H100", "H200", "H800"))
             for d in gpus)


HOPPER_COUNT = _hopper_count()


