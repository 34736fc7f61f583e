"""What scripts/maxtext_ab.py says about a comparison (issue 30, items 2, 3):
a verdict line per arm (losses, which arm is faster and by how much), the
CPU caveat on CPU, and a plot with a loss-difference panel, whole-number
step ticks and the verdict in its title. Made-up runs: no MaxText."""

import matplotlib

matplotlib.use("Agg")

import pytest  # pylint: disable=g-import-not-at-top

from host_test_utils import maxtext_ab


def _run(arm, step_ms, losses):
  timed = [step_ms / 1e3] * (len(losses) - 2)
  return {"arm": arm, "rc": 0, "seconds": 10.0, "command": f"run {arm}",
          "xla_flags": "", "losses": list(losses),
          "step_times_s": [9.0, 9.0] + timed, "timed_step_times_s": timed,
          "median_step_ms": step_ms, "decisions": [],
          "decision_summary": None, "profile": None}


def _result(ab, machine, ring_ms=25.0, ring_losses=None):
  losses = [6.0, 5.8, 5.5, 5.3, 5.2]
  arms = [_run("off", 20.0, losses),
          _run("ring", ring_ms, ring_losses or [x + 1e-4 for x in losses])]
  return {"title": "model_name=llama2-7b", "argv": "", "dtype": "bfloat16",
          "rounds": 1, "machine": machine, "versions": "", "arms": arms,
          "baselines": {}, "comparison": ab.compare(arms, "bfloat16"),
          "profile_comparisons": {}}


@pytest.mark.parametrize("ring_ms, verdict", [
    (25.0, "ring is 25.0 % slower than off"),
    (19.0, "ring is 5.0 % faster than off")])
def test_one_verdict_line_per_arm_with_losses_and_speed(ring_ms, verdict):
  ab = maxtext_ab()
  result = _result(ab, "2 x NVIDIA H200, gpu-host", ring_ms)
  (line,) = ab.verdicts(result)
  assert line.startswith("ring vs off: losses match (max relative "
                         "difference ")
  assert verdict in line
  assert line in ab.markdown(result)
  assert verdict in ab.figure(result)._suptitle.get_text()  # pylint: disable=protected-access


def test_losses_that_differ_are_said_not_to_match():
  ab = maxtext_ab()
  result = _result(ab, "8 x cpu, host",
                   ring_losses=[6.0, 5.8, 5.5, 5.3, 6.2])
  assert "ring vs off: losses DO NOT match" in ab.verdicts(result)[0]


def test_on_cpu_report_and_plot_say_step_times_do_not_measure_the_gpu():
  ab = maxtext_ab()
  result = _result(ab, "8 x cpu, host")
  caveat = ab._ab_lib().CPU_STEP_TIME_CAVEAT  # pylint: disable=protected-access
  assert ab.verdicts(result)[-1] == caveat
  assert caveat in ab.markdown(result)
  title = ab.figure(result)._suptitle.get_text()  # pylint: disable=protected-access
  assert "do not measure the GPU overlap" in title
  gpu = _result(ab, "2 x NVIDIA H200, gpu-host")
  assert caveat not in ab.markdown(gpu)


def test_the_plot_has_a_loss_difference_panel_and_whole_step_ticks():
  ab = maxtext_ab()
  result = _result(ab, "8 x cpu, host")
  fig = ab.figure(result)
  (diff,) = [ax for ax in fig.axes if ax.get_ylabel() == "loss difference"]
  (line,) = [l for l in diff.get_lines() if l.get_label() == "ring - off"]
  assert list(line.get_ydata()) == pytest.approx([1e-4] * 5)
  fig.canvas.draw()
  for ax in fig.axes:
    if ax.get_xlabel() == "step":
      assert all(float(t).is_integer() for t in ax.get_xticks())
