"""tools/maxtext_coverage.py without MaxText: its table row is what the
launcher's closing summary says (tests/integrations/maxtext/test_coverage.py
runs it on real MaxText)."""
import json
import os
import subprocess
import sys
import types

import collective_matmul as cm
from collective_matmul.integrations.maxtext import summary
from collective_matmul.record import Decision

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
import maxtext_coverage  # pylint: disable=g-import-not-at-top,wrong-import-position

CPU = "pallas unavailable: backend is 'cpu', the kernel needs a CUDA GPU"
BLOCK = maxtext_coverage.Block("mixtral", "mixtral-8x7b", ())


def _decision(name, rewritten, reason, collective=None):
  return Decision(name=name, rewritten=rewritten,
                  impl="ring" if rewritten else None, reason=reason,
                  lhs_shape=(8, 128, 256), rhs_shape=(256, 512),
                  dtype="float32", axis="tensor_sequence" if rewritten
                  else None, collective=collective)


def _stdout(records):
  text = summary.summary(records, cm.CollectiveMatmulConfig(enabled=True),
                         "0.2.5", attention_on=False)
  return f"MaxText's log\n{text}\nI1202 metric_logger.py] completed step: 1\n"


def test_the_row_lists_what_the_summary_served_and_left_with_reasons():
  experts = "left to MaxText: routed experts (jax.lax.ragged_dot): ..."
  records = [
      _decision("attention/query", True, CPU, "all_gather"),
      _decision("attention/out", True, CPU, "reduce_scatter"),
      _decision("moe/gate", False, "left to MaxText: the router gate ..."),
      _decision("moe/wi_0", False, experts),
      _decision("moe/wo", False, experts)]
  coverage = maxtext_coverage.read_summary(BLOCK, _stdout(records))
  assert (coverage.rewritten, coverage.total) == (2, 5)
  assert coverage.served == (
      "attention/query: ring over 'tensor_sequence'",
      "attention/out: ring over 'tensor_sequence' (matmul + reduce-scatter)")
  assert coverage.left == ("moe/gate: left to MaxText: the router gate ...",
                           f"moe/wi_0, moe/wo: {experts}")
  assert coverage.row() == (
      "| `mixtral` | `mixtral-8x7b` | 2 of 5 | attention/query: ring over "
      "'tensor_sequence'<br>attention/out: ring over 'tensor_sequence' "
      "(matmul + reduce-scatter) | moe/gate: left to MaxText: the router "
      f"gate ...<br>moe/wi_0, moe/wo: {experts} |")


def test_fp8_gradient_matmuls_count_with_the_projections_in_the_table():
  """The summary counts `NAME/dgrad` apart and notes fp8 siblings; the
  tables count each fp8 projection twice, as their text says."""
  def fp8(name, collective, dtype="e4m3 x e4m3 -> f32"):
    return Decision(name=name, rewritten=True, impl="ring", reason=CPU,
                    lhs_shape=(8, 128, 256), rhs_shape=(256, 512),
                    dtype=dtype, axis="tensor_sequence",
                    collective=collective)
  records = [fp8("mlp/wi_0", "all_gather"), fp8("mlp/wi_1", "all_gather"),
             fp8("mlp/wi_1/dgrad", "reduce_scatter", "e5m2 x e4m3 -> f32"),
             fp8("mlp/wi_0/dgrad", "reduce_scatter", "e5m2 x e4m3 -> f32"),
             _decision("moe/gate", False, "left to MaxText: the gate")]
  stdout = _stdout(records)
  assert "fp8 siblings not grouped" in stdout
  coverage = maxtext_coverage.read_summary(BLOCK, stdout)
  assert (coverage.rewritten, coverage.total) == (4, 5)
  assert coverage.served == (
      "mlp/wi_0, mlp/wi_1: ring over 'tensor_sequence'",
      "mlp/wi_1/dgrad, mlp/wi_0/dgrad: ring over 'tensor_sequence' (matmul "
      "+ reduce-scatter)")
  assert coverage.left == ("moe/gate: left to MaxText: the gate",)


def test_nothing_left_and_nothing_served_say_none():
  coverage = maxtext_coverage.read_summary(
      BLOCK, _stdout([_decision("mlp/wi_0", True, CPU, "all_gather")]))
  assert coverage.left == () and coverage.row().endswith("| (none) |")
  coverage = maxtext_coverage.read_summary(
      BLOCK, _stdout([_decision("mlp/wi_0", False, "excluded")]))
  assert coverage.served == () and "| 0 of 1 | (none) |" in coverage.row()


def test_a_run_without_a_summary_is_a_row_that_says_so():
  coverage = maxtext_coverage.read_summary(BLOCK, "Traceback ...\n")
  assert coverage.rewritten is None
  assert "did not run" in coverage.row() and "no closing summary" in (
      coverage.row())


def test_every_block_is_named_once_and_help_needs_no_maxtext():
  names = [b.name for b in maxtext_coverage.BLOCKS]
  assert len(names) == len(set(names))
  run = subprocess.run([sys.executable, os.path.join(
      REPO_ROOT, "tools", "maxtext_coverage.py"), "--help"],
                       capture_output=True, text=True, timeout=60)
  assert run.returncode == 0 and "usage" in run.stdout.lower()
  assert all(name in run.stdout for name in names)


def test_the_document_reads_back_row_by_block(tmp_path):
  other = maxtext_coverage.Block("gemma", "gemma-2b", ())
  coverages = [maxtext_coverage.read_summary(block, _stdout([_decision(
      "mlp/wi_0", True, CPU, "all_gather")])) for block in (BLOCK, other)]
  path = tmp_path / "coverage.md"
  path.write_text(maxtext_coverage.document(coverages))
  rows = maxtext_coverage.committed_rows(str(path))
  assert rows == {"mixtral": coverages[0].row(), "gemma": coverages[1].row()}


def test_the_fp8_document_names_its_setting_and_the_committed_files_read_back():
  """`--quantization fp8`: its own title, `quantization=fp8` among the
  common settings, and the committed tables' text is what `document`
  writes for their rows (no hand edits: regenerate with the tool)."""
  coverage = maxtext_coverage.read_summary(BLOCK, _stdout([_decision(
      "mlp/wi_0", True, CPU, "all_gather")]))
  text = maxtext_coverage.document([coverage], "fp8")
  assert text.startswith("# MaxText coverage with `quantization=fp8`\n")
  assert "dtype=float32" in text and "quantization=fp8`" in text
  assert "quantization" not in maxtext_coverage.document([coverage])
  for quantization, path in [(None, maxtext_coverage.DEFAULT_OUT),
                             ("fp8", maxtext_coverage.QUANTIZATIONS["fp8"])]:
    kept = [maxtext_coverage._merged(  # pylint: disable=protected-access
        [], maxtext_coverage.committed_rows(path, losses=losses))
            for losses in (False, True)]
    with open(path) as f:
      assert maxtext_coverage.document(kept[0], quantization,
                                       kept[1]) == f.read(), path


def _check(on, off, floor, error=""):
  return maxtext_coverage.LossCheck(BLOCK, on, off, floor, error)


def test_the_losses_row_gives_each_run_and_the_largest_differences():
  row = _check((7.5, 7.4, 7.3), (7.5, 7.4, 7.29), (7.5, 7.41, 7.3)).row()
  assert row == ("| `mixtral` | 7.500000 7.400000 7.300000 | 7.500000 "
                 "7.400000 7.290000 | 1.4e-03 | 1.4e-03 |")
  row = _check((), (), (), "plugin off (off): Boom|").row()
  assert row == "| `mixtral` | did not run |  |  | plugin off (off): Boom\\| |"


def test_a_block_that_did_not_run_is_not_trained_again(tmp_path):
  coverage = maxtext_coverage.read_summary(BLOCK, "Traceback ...\n")
  check = maxtext_coverage.check_losses(coverage, str(tmp_path))
  assert check.error == "no closing summary"


def test_the_document_reads_back_both_tables(tmp_path):
  coverage = maxtext_coverage.read_summary(BLOCK, _stdout([_decision(
      "mlp/wi_0", True, CPU, "all_gather")]))
  check = _check((7.5, 7.4), (7.5, 7.41), (7.5, 7.405))
  path = tmp_path / "coverage.md"
  path.write_text(maxtext_coverage.document([coverage], "fp8", [check]))
  assert maxtext_coverage.committed_rows(str(path)) == {
      "mixtral": coverage.row()}
  assert maxtext_coverage.committed_rows(str(path), losses=True) == {
      "mixtral": check.row()}
  assert "## The same loss" in path.read_text()
  assert ("Blocks trained: 1. On vs off: median 1.3e-03, largest 1.3e-03. "
          "Plugin off, tensor vs tensor_sequence: median 6.7e-04, largest "
          "6.7e-04.") in path.read_text()
  assert "## The same loss" not in maxtext_coverage.document([coverage])


def test_the_runs_differ_only_in_plugin_and_mesh_and_read_the_metrics(
    tmp_path, monkeypatch):
  """Plugin off drops the flag; FLOOR_MESH replaces COMMON's mesh (not
  appended beside it); each run's losses come from its own metrics file."""
  argvs = []

  def fake_run(argv, **kwargs):
    del kwargs
    argvs.append(argv)
    (metrics,) = [a.split("=", 1)[1] for a in argv
                  if a.startswith("metrics_file=")]
    with open(metrics, "w") as f:
      for step in range(3):
        f.write(json.dumps({"learning/loss": 7.0 + len(argvs) + step / 10,
                            "step": step}) + "\n")
    return subprocess.CompletedProcess(argv, 0, _stdout([_decision(
        "mlp/wi_0", True, CPU, "all_gather")]), "")

  monkeypatch.setattr(maxtext_coverage.subprocess, "run", fake_run)
  monkeypatch.setitem(sys.modules, "maxtext", types.SimpleNamespace(
      __file__=str(tmp_path / "maxtext" / "__init__.py")))
  coverage = maxtext_coverage.run_block(BLOCK, str(tmp_path),
                                        quantization="fp8")
  check = maxtext_coverage.check_losses(coverage, str(tmp_path),
                                        quantization="fp8")
  assert coverage.losses == (8.0, 8.1, 8.2)
  assert (check.on, check.off, check.floor) == (
      (8.0, 8.1, 8.2), (9.0, 9.1, 9.2), (10.0, 10.1, 10.2))
  on, off, floor = argvs
  assert "--use_collective_matmul" in on
  assert "--use_collective_matmul" not in off + floor
  assert all("quantization=fp8" in a for a in argvs)
  strip = lambda argv: [a for a in argv if not a.startswith(
      ("run_name=", "metrics_file=", "--use_collective_matmul"))]
  assert strip(on) == strip(off)
  assert "ici_tensor_sequence_parallelism=4" in off
  changed = sorted(set(strip(floor)) - set(strip(off)))
  assert changed == sorted(f"{k}={v}" for k, v in
                           maxtext_coverage.FLOOR_MESH.items())
  assert "ici_tensor_sequence_parallelism=4" not in floor
