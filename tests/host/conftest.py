"""CPU tests of the reference host on 8 emulated devices (tests/conftest.py
sets them up and gives the seed fixtures)."""
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
