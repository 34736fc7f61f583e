"""`prepare_xla_for_kernels` (the one place that sets XLA_FLAGS for the
kernels) and a selection layer that only reads the environment."""
import ast
import os

import collective_matmul as cm
from collective_matmul import selection

OFF = selection.COMMAND_BUFFER_FLAG


def test_prepare_switches_command_buffers_off_and_keeps_other_flags(
    monkeypatch, rng):
  other = f"--xla_force_host_platform_device_count={int(rng.integers(1, 9))}"
  monkeypatch.setenv("XLA_FLAGS", other)
  assert selection.command_buffer_reason("gpu") is not None
  assert cm.prepare_xla_for_kernels()
  assert os.environ["XLA_FLAGS"].split() == [other, OFF]
  assert selection.command_buffer_reason("gpu") is None
  assert cm.prepare_xla_for_kernels()  # Once only.
  assert os.environ["XLA_FLAGS"].split() == [other, OFF]


def test_prepare_leaves_an_explicit_command_buffer_setting(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", f"{OFF}FUSION,CUBLAS")
  assert not cm.prepare_xla_for_kernels()
  assert os.environ["XLA_FLAGS"] == f"{OFF}FUSION,CUBLAS"


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
