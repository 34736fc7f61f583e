"""The SM clock and power a GPU holds while it runs one kernel back to back.

A Hopper GEMM at these sizes is power-bound: the clock it holds depends on
how much energy a kernel spends per flop (loads from L2, not only the
tensor cores), so two kernels with the same cycles can differ in time.
`sustained(fn, seconds)` calls `fn` back to back for `seconds` while
`nvidia-smi` samples the GPU every 50 ms, and returns the median over the
second half of the samples (the clock settles within a few hundred ms).
`tensor_share` turns a time and a clock into the share of the tensor
cores' peak the kernel reached in cycles (4096 dense bf16 flop per cycle
per SM on Hopper): with the clock divided out, it is what the kernel's
schedule costs, apart from power.

  python tools/gpu_clocks.py   # the GPU's clock and power now, idle
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time

FIELDS = ("clocks.sm", "power.draw", "temperature.gpu",
          "clocks_event_reasons.active")
FLOP_PER_CYCLE_PER_SM = 4096  # Dense bf16/f16 wgmma, Hopper.


def parse(lines):
  """nvidia-smi CSV lines (`FIELDS`, no header, no units) -> samples."""
  samples = []
  for line in lines:
    cells = [c.strip() for c in line.split(",")]
    if len(cells) != len(FIELDS):
      continue
    try:
      mhz, watts, celsius = float(cells[0]), float(cells[1]), float(cells[2])
    except ValueError:  # "[N/A]", a warning line.
      continue
    samples.append({"sm_mhz": mhz, "power_w": watts, "temp_c": celsius,
                    "reasons": cells[3]})
  return samples


def summarize(samples):
  """Medians over the second half of the samples (steady state), and the
  most frequent clock event reasons there."""
  if not samples:
    return {}
  steady = samples[len(samples) // 2:]
  reasons = [s["reasons"] for s in steady]
  return {
      "sm_mhz": statistics.median(s["sm_mhz"] for s in steady),
      "power_w": round(statistics.median(s["power_w"] for s in steady), 1),
      "temp_c": statistics.median(s["temp_c"] for s in steady),
      "reasons": max(set(reasons), key=reasons.count),
      "samples": len(steady),
  }


def sustained(fn, seconds: float, gpu: int = 0, calls_per_sync: int = 20):
  """Runs `fn()` (returns arrays) back to back for `seconds` while sampling
  GPU `gpu`; returns `summarize`'s dict ({} where nvidia-smi fails)."""
  import jax  # Only here: the parser is tested without a GPU.
  cmd = ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}",
         "--format=csv,noheader,nounits", "-lms", "50", "-i", str(gpu)]
  try:
    # Its own process group, so that stopping it stops all of it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
  except OSError:
    return {}
  try:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
      out = None
      for _ in range(calls_per_sync):
        out = fn()
      jax.block_until_ready(out)
  finally:
    try:
      os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # It had already exited.
      pass
    text, _ = proc.communicate(timeout=10)
  return summarize(parse(text.splitlines()))


def tensor_share(flops: float, time_us: float, sm_mhz: float,
                 num_sms: int) -> float:
  """The share of the tensor cores' peak in cycles: flops over what
  `num_sms` SMs could do in `time_us` at `sm_mhz`."""
  cycles = time_us * sm_mhz  # us x MHz = cycles.
  return flops / (cycles * num_sms * FLOP_PER_CYCLE_PER_SM)


if __name__ == "__main__":
  import argparse  # pylint: disable=g-import-not-at-top
  argparse.ArgumentParser(
      description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
  try:
    text = subprocess.run(
        ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}",
         "--format=csv,noheader,nounits"], capture_output=True, text=True,
        check=False).stdout
  except OSError as e:
    raise SystemExit(f"cannot run nvidia-smi: {e.strerror or e}") from None
  print(parse(text.splitlines()))
