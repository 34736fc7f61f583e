"""Code comments state the mechanism; measurements and their history live
in docs/TUNING.md and benchmarks/RESULTS.md, which are updated when the code
changes. A run number in plugin/ goes stale silently, so none is allowed."""
import pathlib
import re

import collective_matmul

RUN_NUMBER = re.compile(r"\bruns? \d+|\brun\d+_|\bthe seed'?s?\b|kernel_lead/")


def test_plugin_code_cites_no_benchmark_runs():
  root = pathlib.Path(collective_matmul.__file__).parent
  hits = [f"{path.relative_to(root)}:{i}: {line.strip()}"
          for path in sorted(root.rglob("*.py"))
          for i, line in enumerate(path.read_text().splitlines(), 1)
          if RUN_NUMBER.search(line)]
  assert not hits, "\n".join(hits)
