"""CPU tests of the matmul-reduce-scatter half of the plugin, 8 emulated
devices."""
import os

# Before JAX is imported anywhere: meshes of up to 8 devices on CPU.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import numpy as np  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top


@pytest.fixture
def rng(request):
  """A fresh random generator per test; the seed is printed on failure."""
  # CM_TEST_SEED=<printed seed> replays a failure.
  seed = int(os.environ.get("CM_TEST_SEED",
                            np.random.SeedSequence().entropy % (2**31)))
  print(f"{request.node.name}: seed {seed} (replay: CM_TEST_SEED={seed})")
  return np.random.default_rng(seed)
