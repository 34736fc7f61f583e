"""CPU tests of the collective_matmul plugin on 8 emulated devices."""
import os

# Before JAX is imported anywhere: meshes of up to 8 devices on CPU.
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import zlib  # pylint: disable=g-import-not-at-top

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

import collective_matmul as cm  # pylint: disable=g-import-not-at-top

# One fresh seed per session (printed on failure), so inputs change between
# runs; every test folds in its own id so no two tests share a key.
_SESSION_SEED = int(os.environ.get(
    "CM_TEST_SEED", np.random.SeedSequence().entropy % (2**31)))


def pytest_report_header(config):
  del config
  return f"collective_matmul tests: CM_TEST_SEED={_SESSION_SEED}"


class Keys:
  """Distinct jax.random keys: `keys()` returns a new one on every call."""

  def __init__(self, base):
    self._base = base
    self._count = 0

  def __call__(self):
    self._count += 1
    return jax.random.fold_in(self._base, self._count)


@pytest.fixture
def keys(request):
  node = zlib.crc32(request.node.nodeid.encode())
  print(f"{request.node.nodeid}: CM_TEST_SEED={_SESSION_SEED}")
  return Keys(jax.random.fold_in(jax.random.key(_SESSION_SEED), node))


@pytest.fixture(autouse=True)
def _clean_plugin_state():
  """Every test starts with an empty decision record and no configuration
  set in code (so the default, or parsed flags, apply)."""
  cm.clear_decisions()
  cm.set_config(None)
  yield
  cm.set_config(None)
  cm.clear_decisions()


def pytest_configure(config):
  assert jax.device_count() >= 8, (
      "XLA_FLAGS was set too late: JAX was imported before conftest.py")
  del config
