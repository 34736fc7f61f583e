"""CPU tests of the GPU tools (tools/): their --plan, rows and helpers run
without a GPU (tests/conftest.py sets up the emulated devices and seeds)."""
import importlib.util
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# Until setup.py installs them, import the packages from the checkout.
for _package, _folder in (("reference_host", "host"),
                          ("collective_matmul", "plugin")):
  if importlib.util.find_spec(_package) is None:
    sys.path.insert(0, os.path.join(REPO_ROOT, _folder))
