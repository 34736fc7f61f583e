"""Loaded before every test folder's conftest: 8 emulated CPU devices, the
one session seed, and a clean plugin state per test.

XLA reads XLA_FLAGS once, when JAX first initialises a backend, so this must
happen before any conftest or test module imports JAX (the GPU suite's
conftest does, to look for Hopper GPUs). On a GPU machine the flag only
affects the CPU host platform.
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS",
                                                                ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

# XLA's command buffers off: the decisions the tests pin do not then depend
# on whether this JAX's kernels are checked under CUDA-graph capture
# (collective_matmul.selection.command_buffer_reason; on Python 3.11's JAX
# 0.10 they are not). tools/command_buffer_check.py checks the kernels
# with them on.
if "--xla_gpu_enable_command_buffer=" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_gpu_enable_command_buffer="

import importlib.util  # pylint: disable=g-import-not-at-top
import sys  # pylint: disable=g-import-not-at-top
import zlib  # pylint: disable=g-import-not-at-top

# Until setup.py installs them, import the packages from the checkout.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _package, _folder in (("reference_host", "host"),
                          ("collective_matmul", "plugin")):
  if importlib.util.find_spec(_package) is None:
    sys.path.insert(0, os.path.join(_REPO_ROOT, _folder))

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

# One fresh seed per session (printed in the header and on failure), so
# inputs change between runs; CM_TEST_SEED=<n> replays a run. Every test
# folds in its own id, so no two tests share their random inputs.
_SESSION_SEED = int(os.environ.get(
    "CM_TEST_SEED", np.random.SeedSequence().entropy % (2**31)))


def pytest_report_header(config):
  del config
  return f"collective_matmul tests: CM_TEST_SEED={_SESSION_SEED}"


def pytest_configure(config):
  del config
  assert jax.device_count("cpu") >= 8, (
      "XLA_FLAGS was set too late: JAX was imported before conftest.py")


def _test_seed(request) -> int:
  print(f"{request.node.nodeid}: CM_TEST_SEED={_SESSION_SEED}")
  return (_SESSION_SEED + zlib.crc32(request.node.nodeid.encode())) % (2**31)


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
  """jax.random keys of this test, from the session seed."""
  return Keys(jax.random.key(_test_seed(request)))


@pytest.fixture
def rng(request):
  """A numpy random generator of this test, from the session seed."""
  return np.random.default_rng(_test_seed(request))


@pytest.fixture
def fresh_interpreter():
  """After a kernel raised in Mosaic GPU's interpret mode, the interpreter
  must be reset before it runs another one (`InterpretGPUParams`'
  docstring)."""
  yield
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # pylint: disable=g-import-not-at-top
  gpu_callbacks.reset_gpu_interpret_mode_state()


@pytest.fixture(autouse=True)
def _clean_plugin_state():
  """Every test starts with an empty decision record and no configuration
  set in code (so the default, or parsed flags, apply), and leaves absl's
  flags unparsed if it found them so: `get_config` reads parsed flags, and
  a test that parses them in passing (one of tests/integrations did)
  would otherwise change what later tests see, by the order they run in."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  import collective_matmul as cm  # pylint: disable=g-import-not-at-top
  cm.clear_decisions()
  cm.set_config(None)
  parsed = flags.FLAGS.is_parsed()
  yield
  if flags.FLAGS.is_parsed() and not parsed:
    flags.FLAGS.unparse_flags()
  cm.set_config(None)
  cm.clear_decisions()


# CI's second stage (Python 3.12, JAX 0.12, real MaxText) runs what differs
# there, not the whole suite again: the tests the first stage skipped
# (real MaxText, the kernels lowered for CUDA and interpreted, whatever
# needs a newer JAX) and the folders whose code paths depend on JAX's
# version (`EVERY_JAX`). `CM_RECORD_SKIPPED=FILE` writes the skipped
# tests' ids to FILE; `CM_RUN_SKIPPED_IN=FILE` keeps only those and the
# `EVERY_JAX` folders (.ci/run).
EVERY_JAX = ("tests/ops/", "tests/override/", "tests/kernels/",
             "tests/integrations/", "tests/package/")
_RECORD_SKIPPED = os.environ.get("CM_RECORD_SKIPPED")
_RUN_SKIPPED_IN = os.environ.get("CM_RUN_SKIPPED_IN")
_skipped_ids = []


def pytest_collection_modifyitems(config, items):
  if not _RUN_SKIPPED_IN:
    return
  with open(_RUN_SKIPPED_IN, encoding="utf-8") as f:
    listed = set(f.read().split("\n")) - {""}
  if not listed:
    raise pytest.UsageError(f"CM_RUN_SKIPPED_IN={_RUN_SKIPPED_IN} lists no "
                            "test: the first stage recorded no skip?")
  keep, drop = [], []
  for item in items:
    every = item.nodeid.startswith(EVERY_JAX)
    (keep if every or item.nodeid in listed else drop).append(item)
  if drop:
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
  print(f"\nCM_RUN_SKIPPED_IN: {len(keep)} tests kept ({len(listed)} "
        f"skipped in the first stage, plus {', '.join(EVERY_JAX)}), "
        f"{len(drop)} deselected")


def pytest_runtest_logreport(report):
  if _RECORD_SKIPPED and report.skipped:
    _skipped_ids.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
  del session, exitstatus
  if _RECORD_SKIPPED:
    with open(_RECORD_SKIPPED, "w", encoding="utf-8") as f:
      f.write("".join(f"{nodeid}\n" for nodeid in sorted(set(_skipped_ids))))
