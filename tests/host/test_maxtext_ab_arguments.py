"""scripts/maxtext_ab.py refuses a bad command line before the first arm
(issue 39, items 3 and 8): every arm used to run and fail, or the results
were lost at the end."""
import sys

import pytest

from host_test_utils import maxtext_ab


def _main(monkeypatch, *args):
  """maxtext_ab.main() with `args`; the arms it would have run."""
  ab = maxtext_ab()
  calls = []
  monkeypatch.setattr(ab, "run_arm", lambda spec, *a, **k: calls.append(spec))
  monkeypatch.setattr(sys, "argv", ["maxtext_ab.py", *args])
  with pytest.raises(SystemExit) as exit_info:
    ab.main()
  return exit_info.value.code, calls


@pytest.mark.parametrize("under", ["", "sub"])
def test_an_out_that_is_or_is_under_a_file_is_refused_before_any_arm(
    tmp_path, monkeypatch, capsys, under):
  taken = tmp_path / "taken"
  taken.write_text("not a directory")
  out = taken / under if under else taken
  code, calls = _main(monkeypatch, "--out", str(out), "--arms", "off,auto",
                      "--", "base.yml", "steps=5")
  assert (code, calls) == (2, [])
  err = capsys.readouterr().err
  assert f"{taken} is a file, not a directory" in err
  assert "Traceback" not in err
  assert taken.read_text() == "not a directory"


@pytest.mark.parametrize("timeout", ["-1", "0"])
def test_a_timeout_that_is_not_positive_is_refused(tmp_path, monkeypatch,
                                                   capsys, timeout):
  code, calls = _main(monkeypatch, "--out", str(tmp_path), "--timeout",
                      timeout, "--", "base.yml")
  assert (code, calls) == (2, [])
  assert f"--timeout={timeout} must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("arm", ["=", "=--use_collective_matmul", " ",
                                 "a/b=--use_collective_matmul"])
def test_an_extra_arm_without_a_usable_name_is_refused(tmp_path, monkeypatch,
                                                       capsys, arm):
  code, calls = _main(monkeypatch, "--out", str(tmp_path), "--arm", arm,
                      "--", "base.yml")
  assert (code, calls) == (2, [])
  err = capsys.readouterr().err
  assert "arm" in err.splitlines()[-1] and "Traceback" not in err


def test_an_empty_name_in_arms_is_refused(tmp_path, monkeypatch, capsys):
  code, calls = _main(monkeypatch, "--out", str(tmp_path), "--arms",
                      "off,,auto", "--", "base.yml")
  assert (code, calls) == (2, [])
  assert "an empty arm" in capsys.readouterr().err


def test_a_named_extra_arm_still_parses():
  assert maxtext_ab().parse_arm(
      "auto.noscan-2=--use_collective_matmul scan_layers=False "
      "--xla_foo=1") == ("auto.noscan-2", ("--use_collective_matmul",
                                           "scan_layers=False"),
                         "--xla_foo=1")
