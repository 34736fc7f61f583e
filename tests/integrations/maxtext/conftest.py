"""Tests against the real MaxText package (Python >= 3.12, `.[maxtext]`).

Where MaxText is not installed (the Python 3.11 suite) they skip, unless
CM_REQUIRE_MAXTEXT=1 (CI's Python 3.12 block sets it), where a missing
MaxText is an error: that block must never pass by skipping.
"""
import importlib.util
import os

import pytest

_HAVE_MAXTEXT = importlib.util.find_spec("maxtext") is not None

# The MaxText runs are subprocesses in their own directories: a relative
# PYTHONPATH (`PYTHONPATH=plugin:host` from the checkout) would find nothing
# there and they would import whatever collective_matmul is installed (e.g.
# another checkout's, editable) instead of this one's. Absolute from here on.
if os.environ.get("PYTHONPATH"):
  os.environ["PYTHONPATH"] = os.pathsep.join(
      os.path.abspath(p) for p in os.environ["PYTHONPATH"].split(os.pathsep)
      if p)


def pytest_collection_modifyitems(config, items):
  del config
  if _HAVE_MAXTEXT:
    return
  if os.environ.get("CM_REQUIRE_MAXTEXT") == "1":
    raise pytest.UsageError(
        "CM_REQUIRE_MAXTEXT=1 but MaxText is not importable: pip install -e "
        "'.[maxtext,test]' on Python >= 3.12")
  here = os.path.dirname(os.path.abspath(__file__))
  skip = pytest.mark.skip(reason="MaxText is not installed (needs Python "
                                 ">= 3.12 and .[maxtext])")
  for item in items:
    if str(item.fspath).startswith(here):
      item.add_marker(skip)
