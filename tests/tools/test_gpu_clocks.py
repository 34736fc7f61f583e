"""tools/gpu_clocks.py: the clock and power a GPU holds under a kernel,
from nvidia-smi's CSV (a fake nvidia-smi here: no GPU on CI)."""
import os
import stat
import subprocess
import sys

import jax.numpy as jnp
import pytest

from cm_test_utils import import_script

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _clocks():
  return import_script("gpu_clocks")


def test_parse_keeps_complete_numeric_rows_only():
  rows = _clocks().parse([
      "1485, 691.20, 58, 0x0000000000000004",
      "[N/A], 80.0, 36, 0x0000000000000001",   # no clock reading
      "1500, 690.0",                           # cut short
      "WARNING: something",
  ])
  assert rows == [{"sm_mhz": 1485.0, "power_w": 691.2, "temp_c": 58.0,
                   "reasons": "0x0000000000000004"}]


def test_summary_is_the_steady_second_half():
  g = _clocks()
  ramp = [f"{mhz}, {w}, 50, 0x1" for mhz, w in ((1980, 100), (1900, 300))]
  held = [f"{mhz}, 690, 58, 0x4" for mhz in (1500, 1485, 1470, 1485)]
  summary = g.summarize(g.parse(ramp + held))
  assert summary == {"sm_mhz": 1485.0, "power_w": 690.0, "temp_c": 58.0,
                     "reasons": "0x4", "samples": 3}
  assert g.summarize([]) == {}


def test_tensor_share_divides_flops_by_the_cycles_at_the_clock():
  g = _clocks()
  # 132 SMs x 4096 flop per cycle for 1000 cycles (1 us at 1000 MHz).
  assert g.tensor_share(132 * 4096 * 1000, 1.0, 1000.0, 132) == pytest.approx(1.0)
  assert g.tensor_share(132 * 4096 * 500, 1.0, 1000.0, 132) == pytest.approx(0.5)


def _fake_smi(tmp_path, monkeypatch, body):
  smi = tmp_path / "nvidia-smi"
  smi.write_text("#!/bin/sh\n" + body)
  smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_sustained_runs_the_kernel_while_sampling(tmp_path, monkeypatch):
  _fake_smi(tmp_path, monkeypatch,
            'for i in 1 2 3 4; do echo "1500, 690.5, 60, 0x4"; done\n'
            "sleep 30\n")
  calls = []

  def kernel():
    calls.append(1)
    return jnp.ones(4)

  summary = _clocks().sustained(kernel, 0.3, calls_per_sync=2)
  assert calls and len(calls) % 2 == 0
  assert summary["sm_mhz"] == 1500.0 and summary["power_w"] == 690.5


def test_sustained_without_nvidia_smi_reports_nothing(tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))  # No nvidia-smi on it.
  assert _clocks().sustained(lambda: jnp.ones(2), 0.05) == {}


def _run_tool(*args):
  return subprocess.run([sys.executable, os.path.join(
      REPO_ROOT, "tools", "gpu_clocks.py"), *args], capture_output=True,
                        text=True, timeout=60, cwd=REPO_ROOT)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_is_printed_without_running_nvidia_smi(tmp_path, monkeypatch,
                                                    flag):
  called = tmp_path / "called"
  _fake_smi(tmp_path, monkeypatch, f"touch {called}\n")
  run = _run_tool(flag)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "usage" in run.stdout.lower() and "sustained" in run.stdout
  assert not called.exists()


def test_without_nvidia_smi_it_says_so_in_one_line(tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))  # No nvidia-smi on it.
  run = _run_tool()
  assert run.returncode == 1
  assert run.stderr.strip().splitlines() == [
      "cannot run nvidia-smi: No such file or directory"]
