"""CPU tests of the reference host on 8 emulated devices."""
import os
import sys

# Before JAX is imported anywhere: meshes of up to 8 devices on CPU.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import importlib.util  # pylint: disable=g-import-not-at-top
import zlib  # pylint: disable=g-import-not-at-top

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# Until setup.py installs them, import the packages from the checkout.
for _package, _folder in (("reference_host", "host"),
                          ("collective_matmul", "plugin")):
  if importlib.util.find_spec(_package) is None:
    sys.path.insert(0, os.path.join(REPO_ROOT, _folder))

import numpy as np  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top


_SESSION_SEED = int(os.environ.get(
    "CM_TEST_SEED", np.random.SeedSequence().entropy % (2**31)))


@pytest.fixture
def rng(request):
  """A fresh random generator per test, from the session seed
  (CM_TEST_SEED=<n> replays a run, as in the plugin tests) and the test's
  name; the seed is printed on failure."""
  seed = (_SESSION_SEED + zlib.crc32(request.node.nodeid.encode())) % (2**31)
  print(f"{request.node.nodeid}: CM_TEST_SEED={_SESSION_SEED}")
  return np.random.default_rng(seed)
