"""scripts/maxtext_ab.py --rounds: arms repeated in alternating order, step
times pooled, every round's losses checked, each round's ratio reported."""
import importlib.util
import json
import sys

import pytest

from host_test_utils import maxtext_ab


def _run(arm, step_ms, losses=(2.0, 1.5, 1.0, 0.9), rc=0, tag=""):
  timed = [ms / 1e3 for ms in step_ms]
  return {"arm": arm, "rc": rc, "seconds": 10.0, "command": f"run {arm}{tag}",
          "xla_flags": "", "losses": list(losses),
          "step_times_s": [9.0, 9.0] + timed, "timed_step_times_s": timed,
          "median_step_ms": sorted(step_ms)[len(step_ms) // 2],
          "decisions": [], "decision_summary": None, "profile": None}


def test_round_orders_reverse_every_other_round():
  ab = maxtext_ab()
  assert ab.round_orders(["off", "a", "b"], 3) == [
      ["off", "a", "b"], ["b", "a", "off"], ["off", "a", "b"]]
  assert ab.round_orders(["off", "a"], 1) == [["off", "a"]]


def test_merge_rounds_pools_the_timed_steps_and_keeps_each_round():
  ab = maxtext_ab()
  first, second = _run("a", [10.0, 11.0, 12.0]), _run("a", [20.0, 21.0, 22.0])
  second["rc"] = 1
  merged = ab.merge_rounds([first, second])
  assert merged["median_step_ms"] == pytest.approx(16.0)  # of all six
  assert merged["rc"] == 1  # the first failing round's
  assert merged["seconds"] == 20.0
  assert [r["median_step_ms"] for r in merged["rounds"]] == [11.0, 21.0]
  assert merged["losses"] == first["losses"]
  assert ab.merge_rounds([first]) is first


def test_compare_reports_each_rounds_ratio_and_checks_every_rounds_losses():
  ab = maxtext_ab()
  arms = [ab.merge_rounds([_run("off", [100.0]), _run("off", [110.0])]),
          ab.merge_rounds([_run("auto", [90.0]), _run("auto", [88.0])])]
  result = ab.compare(arms, "bfloat16")
  rows = {r["arm"]: r for r in result["rows"]}
  assert result["ok"]
  assert rows["auto"]["round_ratios_vs_baseline"] == pytest.approx(
      [0.9, 0.8])
  assert rows["auto"]["ratio_vs_baseline"] == pytest.approx(89.0 / 105.0)
  # A second round whose losses went wrong fails the A/B.
  wrong = ab.merge_rounds([_run("auto", [90.0]),
                           _run("auto", [88.0], losses=(2.0, 1.5, 1.3, 0.9))])
  result = ab.compare([arms[0], wrong], "bfloat16")
  assert not result["ok"]
  assert {r["arm"]: r for r in result["rows"]}["auto"][
      "max_rel_loss_diff"] == pytest.approx(0.3)


def test_main_runs_the_rounds_in_alternating_order(tmp_path, monkeypatch):
  ab = maxtext_ab()
  calls = []
  step_ms = {"off": 100.0, "auto": 95.0}

  def fake_run_arm(spec, maxtext_args, out, timeout, profile_steps=0, tag=""):
    calls.append((spec, tag, profile_steps))
    step_ms[spec] += 1.0  # a drift: every run is slower than the last
    return _run(spec, [step_ms[spec]], tag=tag)

  monkeypatch.setattr(ab, "run_arm", fake_run_arm)
  monkeypatch.setattr(sys, "argv", [
      "maxtext_ab.py", "--out", str(tmp_path), "--arms", "off,auto",
      "--rounds", "3", "--profile_steps", "2", "--", "base.yml",
      "steps=5"])
  assert ab.main() == 0
  assert calls == [("off", "_r0", 2), ("auto", "_r0", 2),
                   ("auto", "_r1", 0), ("off", "_r1", 0),
                   ("off", "_r2", 0), ("auto", "_r2", 0)]
  result = json.load(open(tmp_path / "ab.json"))
  assert result["rounds"] == 3
  auto = {r["arm"]: r for r in result["comparison"]["rows"]}["auto"]
  assert auto["round_ratios_vs_baseline"] == pytest.approx(
      [96 / 101, 97 / 102, 98 / 103])
  report = (tmp_path / "report.md").read_text()
  assert "pooled over 3 rounds" in report
  assert "auto / off, round by round: 0.950, 0.951, 0.951" in report
  if importlib.util.find_spec("matplotlib"):  # with a panel per round
    assert (tmp_path / "ab.png").stat().st_size > 0


def test_rounds_must_be_positive(tmp_path, monkeypatch, capsys):
  ab = maxtext_ab()
  monkeypatch.setattr(sys, "argv", [
      "maxtext_ab.py", "--out", str(tmp_path), "--arms", "off,auto",
      "--rounds", "0", "--", "base.yml"])
  with pytest.raises(SystemExit):
    ab.main()
  assert "--rounds=0 must be >= 1" in capsys.readouterr().err
