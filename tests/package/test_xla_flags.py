"""`prepare_xla_for_kernels` (the one place that sets XLA_FLAGS for the
kernels) and a selection layer that only reads the environment."""
import ast
import os

import collective_matmul as cm
from collective_matmul import selection
from collective_matmul.selection import applicability

OFF = selection.COMMAND_BUFFER_FLAG


def test_prepare_leaves_xla_flags_on_a_checked_jax(monkeypatch):
  # XLA's command buffers on (its default) where this JAX's kernels were
  # checked under capture: the user's XLA_FLAGS stay as they are.
  monkeypatch.setattr(applicability, "_jax_version", lambda: (0, 12))
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_graph_min_graph_size=1")
  assert cm.prepare_xla_for_kernels()
  assert os.environ["XLA_FLAGS"] == "--xla_gpu_graph_min_graph_size=1"


def test_prepare_takes_only_custom_calls_out_on_an_unchecked_jax(
    monkeypatch, rng):
  monkeypatch.setattr(applicability, "_jax_version", lambda: (0, 10))
  other = f"--xla_force_host_platform_device_count={int(rng.integers(1, 9))}"
  monkeypatch.setenv("XLA_FLAGS", f"{other} {OFF}FUSION,CUSTOM_CALL")
  assert selection.command_buffer_reason("gpu") is not None
  assert cm.prepare_xla_for_kernels()
  assert os.environ["XLA_FLAGS"].split() == [
      other, f"{OFF}FUSION,CUSTOM_CALL", f"{OFF}-CUSTOM_CALL"]
  assert selection.command_buffer_types() == {"FUSION"}
  assert cm.prepare_xla_for_kernels()  # Once only.
  assert os.environ["XLA_FLAGS"].count("-CUSTOM_CALL") == 1


def test_the_selection_layer_writes_no_environment():
  folder = os.path.dirname(selection.__file__)
  for file in sorted(os.listdir(folder)):
    if not file.endswith(".py"):
      continue
    with open(os.path.join(folder, file)) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
        targets = getattr(node, "targets", None) or [node.target]
        for target in targets:
          assert "environ" not in ast.unparse(target), (file, node.lineno)
      if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        assert not name.startswith(("os.environ.", "os.putenv")) or (
            name == "os.environ.get"), (file, name)
