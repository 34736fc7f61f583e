"""What the GPU tools do before importing JAX: the user scripts' setup
(scripts/script_setup.py: the packages from the checkout until installed,
8 emulated CPU devices, XLA_FLAGS the kernels may run under), imported
first by them."""
import os
import sys

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(TOOLS_DIR), "scripts"))

from script_setup import REPO_ROOT  # pylint: disable=g-import-not-at-top,unused-import,wrong-import-position
from script_setup import prepare  # pylint: disable=g-import-not-at-top,unused-import,wrong-import-position
