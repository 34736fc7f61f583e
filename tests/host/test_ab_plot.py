"""What the A/B report and plot say (issue 30, items 2 and 3): the loss
difference in its own panel, whole-number step ticks, a title naming the
faster arm and by how much, and on CPU that step times there do not measure
the GPU overlap. Built from a made-up result: no training."""
import matplotlib

matplotlib.use("Agg")

import pytest  # pylint: disable=g-import-not-at-top

import collective_matmul as cm
from reference_host import ab as ab_lib
from reference_host import config as config_lib
from reference_host import trainer as trainer_lib

from host_test_utils import BASE_CONFIG, TEST_MODEL_ARGS


def _result(rng, baseline_ms, collective_ms, device_kind, steps=7):
  config = config_lib.load_config([BASE_CONFIG, *TEST_MODEL_ARGS],
                                  num_devices=8)
  losses = 6.0 - 0.1 * rng.random(steps).cumsum()

  def records(ms, noise):
    return [trainer_lib.StepRecord(
        step=i, loss=float(losses[i] + noise[i]), step_time_s=ms / 1e3,
        tokens_per_s=1.0, tflops_per_device=0.0, mfu=None)
        for i in range(steps)]

  return ab_lib.ABResult(
      config=config, collective_config=cm.CollectiveMatmulConfig(
          enabled=True, impl="ring"),
      baseline=records(baseline_ms, [0.0] * steps),
      collective=records(collective_ms, 1e-6 * rng.standard_normal(steps)),
      decisions=[], baseline_compile_s=1.0, collective_compile_s=1.0,
      relative_tolerance=1e-4, mesh_shape={"data": 2, "tensor_sequence": 4},
      device_kind=device_kind)


@pytest.mark.parametrize("baseline_ms, collective_ms, verdict", [
    (20.0, 25.0, "collective (ring) is 25.0 % slower than baseline"),
    (20.0, 19.0, "collective (ring) is 5.0 % faster than baseline"),
])
def test_the_title_says_which_arm_is_faster_and_by_how_much(
    rng, baseline_ms, collective_ms, verdict):
  result = _result(rng, baseline_ms, collective_ms, "NVIDIA H200")
  fig = ab_lib.figure(result)
  title = fig._suptitle.get_text()  # pylint: disable=protected-access
  assert verdict in title and "losses match" in title
  assert "CPU" not in title
  assert verdict in ab_lib.summary(result)


def test_a_loss_difference_panel_with_whole_step_ticks(rng):
  result = _result(rng, 20.0, 25.0, "cpu")
  fig = ab_lib.figure(result)
  diff_axes = [ax for ax in fig.axes if ax.get_ylabel() == "loss difference"]
  assert len(diff_axes) == 1
  (line,) = [l for l in diff_axes[0].get_lines() if len(l.get_xdata()) > 2]
  assert list(line.get_ydata()) == pytest.approx(result.loss_diffs)
  fig.canvas.draw()
  for ax in fig.axes:
    if ax.get_xlabel() == "step":
      ticks = ax.get_xticks()
      assert all(float(t).is_integer() for t in ticks), ticks


def test_on_cpu_the_report_and_plot_say_step_times_do_not_measure_the_gpu(
    rng, tmp_path):
  result = _result(rng, 20.0, 25.0, "cpu")
  assert "do not measure the GPU overlap" in ab_lib.figure(
      result)._suptitle.get_text()  # pylint: disable=protected-access
  paths = ab_lib.write_report(result, str(tmp_path))
  report = open(paths["report"]).read()
  assert ab_lib.CPU_STEP_TIME_CAVEAT in report
  assert "benchmarks/RESULTS.md" in ab_lib.CPU_STEP_TIME_CAVEAT
  assert ab_lib.CPU_STEP_TIME_CAVEAT in ab_lib.summary(result)
