"""GPU suite: runs only where JAX sees Hopper GPUs (skipped in CPU CI)."""
import pytest

from gpu_env import HOPPER_COUNT


def pytest_collection_modifyitems(config, items):
  if HOPPER_COUNT:
    return
  skip = pytest.mark.skip(reason="needs a Hopper GPU")
  for item in items:
    if "tests/gpu" in str(item.fspath):
      item.add_marker(skip)
