"""The core GEMMs at the power cap (run 46): for each shape and method, the
kernel time over cuBLAS's against the SM clock it holds when run back to
back. Points further left ran at a lower clock; further down were faster.

  python benchmarks/kernel_lead/plot_power.py

Writes run46_power.png from run46_core_power.json and prints the table.
"""
from __future__ import annotations

import json
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = {"cublas": "cuBLAS", "ours_ag": "ours (AG config)",
           "ours_rs": "ours (RS config)", "ours_pp6": "ping-pong",
           "ours_rs_pp5": "ping-pong (RS)", "upstream_none": "upstream",
           "upstream_m": "upstream, cluster sharing B",
           "upstream_n": "upstream, cluster sharing A"}
MARKERS = "os^vD<>P"


def points(path):
  """{shape: [(method, time / cuBLAS, MHz, W)]} from a bench_gemm_core
  JSON with `--power-seconds`."""
  with open(path) as f:
    rows = json.load(f)["rows"]
  out = {}
  for row in rows:
    base = row["cublas_us"]
    out[row["shape"]] = [
        (name, row[f"{name}_us"] / base, row[f"{name}_clock"]["sm_mhz"],
         row[f"{name}_clock"]["power_w"])
        for name in METHODS if row.get(f"{name}_clock")]
  return out


def main():
  data = points(os.path.join(HERE, "run46_core_power.json"))
  fig, axes = plt.subplots(1, len(data), figsize=(5 * len(data), 4.2))
  for ax, (shape, pts) in zip(axes, data.items()):
    print(f"\n{shape}\n| method | time / cuBLAS | MHz | W |\n|---|---:|---:|---:|")
    for (name, ratio, mhz, watts), marker in zip(pts, MARKERS):
      ax.scatter(mhz, ratio, marker=marker, s=60, label=METHODS[name])
      print(f"| {METHODS[name]} | {ratio:.3f} | {mhz:.0f} | {watts:.0f} |")
    ax.set_title(f"{shape} (all at 687-694 W of 700)")
    ax.set_xlabel("SM clock held back to back (MHz)")
    ax.set_ylabel("kernel time / cuBLAS")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7)
  fig.suptitle("One H200, run 46: the GEMMs run at the power cap, so a "
               "kernel that loads more per flop gets a lower clock")
  fig.tight_layout()
  out = os.path.join(HERE, "run46_power.png")
  fig.savefig(out, dpi=110)
  print(f"\nwrote {out}")


if __name__ == "__main__":
  main()
