"""Shared constants of the host tests (conftest sets up the environment)."""
import importlib.util
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
BASE_CONFIG = os.path.join(REPO_ROOT, "model_configs", "base.yml")
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

# Small enough that a train step compiles in a couple of seconds on 2 cores;
# every sharded dimension divides a tensor axis of 4.
TEST_MODEL_ARGS = ("model_name=tiny", "base_num_decoder_layers=1",
                   "max_target_length=32", "enable_checkpointing=False")


def maxtext_ab():
  """A fresh module of scripts/maxtext_ab.py (each test may patch it)."""
  spec = importlib.util.spec_from_file_location(
      "maxtext_ab", os.path.join(REPO_ROOT, "scripts", "maxtext_ab.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
