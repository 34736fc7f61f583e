"""docs/MAXTEXT_COVERAGE.md is what tools/maxtext_coverage.py finds: a few
blocks' rows reproduced on real MaxText (the whole sweep is slow on CPU)."""
import os
import sys

import pytest

from maxtext_runs import WORK

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
import maxtext_coverage  # pylint: disable=g-import-not-at-top,wrong-import-position


# A MoE block (served attention, the router gate and routed experts left
# with reasons), a tied-embedding one (the logits through the table), and
# qwen3-next (its linear attention, its gated attention's out projection
# and its shared expert's gate left with theirs, under MaxText's own rules).
@pytest.mark.parametrize("block", ["mixtral", "gemma", "qwen3_next"])
def test_the_sweep_reproduces_the_committed_row(block):
  committed = maxtext_coverage.committed_rows()
  assert block in committed, sorted(committed)
  (spec,) = [b for b in maxtext_coverage.BLOCKS if b.name == block]
  coverage = maxtext_coverage.run_block(spec, WORK, timeout=900)
  assert coverage.rewritten is not None, coverage.error
  assert coverage.row() == committed[block]


def test_the_fp8_sweep_reproduces_the_committed_row():
  """docs/MAXTEXT_COVERAGE_FP8.md (`--quantization fp8`): a MoE block's
  fp8 projections served as e4m3 x e4m3 and their input gradients as
  e5m2 x e4m3, the routed experts and the router left as in bf16."""
  committed = maxtext_coverage.committed_rows(
      maxtext_coverage.QUANTIZATIONS["fp8"])
  (spec,) = [b for b in maxtext_coverage.BLOCKS if b.name == "mixtral"]
  coverage = maxtext_coverage.run_block(spec, WORK, timeout=900,
                                        quantization="fp8")
  assert coverage.rewritten is not None, coverage.error
  assert coverage.row() == committed["mixtral"]
  assert "e5m2 x e4m3" in coverage.row()
  # `--losses` reads them from MaxText's metrics file: one per step.
  steps = int(dict(c.split("=", 1) for c in maxtext_coverage.COMMON)["steps"])
  assert len(coverage.losses) == steps, coverage.losses
  assert all(0 < loss < 20 for loss in coverage.losses), coverage.losses
