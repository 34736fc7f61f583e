"""CI's two stages (.ci/run): the first records the tests it skipped
(`CM_RECORD_SKIPPED`), the second keeps only those and the
JAX-version-sensitive folders (`CM_RUN_SKIPPED_IN`, tests/conftest.py).
A mistake here would silently drop the second stage's tests."""
import os
import re
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# A folder outside EVERY_JAX, and one inside it.
_SELECTION = "tests/selection/test_decisions_unchanged.py"
_PACKAGE = "tests/package/test_enums.py"


def _pytest(*args, **env):
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
      env={**os.environ, "CM_RECORD_SKIPPED": "", "CM_RUN_SKIPPED_IN": "",
           **env}, check=False)
  return result.returncode, result.stdout + result.stderr


def _collected(output):
  return [line for line in output.splitlines() if "::" in line]


def test_second_stage_keeps_the_skipped_and_the_version_sensitive(tmp_path):
  code, output = _pytest("--collect-only", _SELECTION, _PACKAGE)
  assert code == 0, output
  selection = [t for t in _collected(output) if t.startswith(_SELECTION)]
  package = [t for t in _collected(output) if t.startswith(_PACKAGE)]
  assert len(selection) >= 2 and package, output
  listed = tmp_path / "skipped.txt"
  listed.write_text(f"{selection[0]}\n")
  code, output = _pytest("--collect-only", _SELECTION, _PACKAGE,
                         CM_RUN_SKIPPED_IN=str(listed))
  assert code == 0, output
  assert sorted(_collected(output)) == sorted([selection[0], *package])
  kept = re.search(r"CM_RUN_SKIPPED_IN: (\d+) tests kept", output)
  assert kept and int(kept.group(1)) == 1 + len(package), output


def test_second_stage_refuses_an_empty_list(tmp_path):
  listed = tmp_path / "skipped.txt"
  listed.write_text("")
  code, output = _pytest("--collect-only", _PACKAGE,
                         CM_RUN_SKIPPED_IN=str(listed))
  assert code != 0 and "lists no test" in output, output


def test_first_stage_records_what_it_skipped(tmp_path):
  # Without a GPU the GPU suite skips itself; the enums test runs.
  gpu = "tests/gpu/test_core_variants.py"
  record = tmp_path / "skipped.txt"
  code, output = _pytest(gpu, _PACKAGE, CM_RECORD_SKIPPED=str(record))
  assert code == 0, output
  recorded = record.read_text().split()
  assert recorded and all(t.startswith(gpu + "::") for t in recorded), (
      recorded, output)
