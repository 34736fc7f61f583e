"""The small-problem cut-off (runs 27-29): for every shape measured, NCCL +
cuBLAS time over the time of the config `selection` picks today, and
whether `impl=auto` takes the kernel there (`selection.too_small_reason`).

  PYTHONPATH=plugin python benchmarks/kernel_lead/plot_small_problems.py

Prints a markdown table and writes run27_29_small_problems.png. A shape
measured in several runs is taken from the latest.
"""
from __future__ import annotations

import json
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from collective_matmul.kernels import configs
from collective_matmul import selection

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = ["run27_ag_small.json", "run27_ag_mid.json", "run28_rs_small.json",
        "run28_ag_senders.json", "run29_edges.json"]


def picked(row):
  """(method key, us) of the config today's selection picks, or None."""
  m, k, n = map(int, row["shape"].split("/"))
  rs = row.get("pattern") == "reduce_scatter"
  want = (selection.select_reduce_scatter_config(m, k, n, "bfloat16", 2)
          if rs else selection.select_config(m, k, n, "bfloat16", 2))
  # A recorded config lacks the fields added since (their defaults).
  cls = configs.ReduceScatterConfig if rs else configs.AllGatherConfig
  for key in sorted(k[:-7] for k in row if k.endswith("_config")):
    if cls(**row[f"{key}_config"]) == want and not row.get(
        f"{key}_loopback"):
      return key, row[f"{key}_us"]
  return None


def main():
  latest = {}
  for name in RUNS:
    for row in json.load(open(os.path.join(HERE, name)))["rows"]:
      latest[(row.get("pattern", "all_gather"), row["shape"])] = (name, row)
  table = []
  for (pattern, shape), (name, row) in sorted(
      latest.items(), key=lambda kv: (kv[0][0], *map(int, kv[0][1].split("/")))):
    m, k, n = map(int, shape.split("/"))
    hit = picked(row)
    if hit is None:
      continue
    key, ours = hit
    auto = selection.too_small_reason(m, k, n, "bfloat16", 2) is None
    table.append((pattern, shape, row["nccl_us"], ours, row["nccl_us"] / ours,
                  auto, name[:5]))
  print("| kernel | m/k/n per shard | NCCL + cuBLAS (us) | ours (us) | "
        "speed-up | `auto` takes the kernel | run |")
  print("|---|---|---|---|---|---|---|")
  for pattern, shape, nccl, ours, speed, auto, run in table:
    kind = "all-gather" if pattern == "all_gather" else "reduce-scatter"
    print(f"| {kind} | {shape} | {nccl:.1f} | {ours:.1f} | {speed:.2f} | "
          f"{'yes' if auto else 'no'} | {run[3:]} |")
  fig, ax = plt.subplots(figsize=(11, 4.5))
  for i, (pattern, shape, _, _, speed, auto, _) in enumerate(table):
    ax.bar(i, speed, color=("tab:blue" if auto else "tab:gray"),
           hatch=(None if pattern == "all_gather" else "//"),
           edgecolor="black", linewidth=0.4)
  ax.axhline(1.0, color="black", linewidth=0.8)
  ax.set_xticks(range(len(table)))
  ax.set_xticklabels([f"{'AG' if p == 'all_gather' else 'RS'} {s}"
                      for p, s, *_ in table], rotation=70, fontsize=7)
  ax.set_ylabel("NCCL + cuBLAS time / ours")
  ax.set_title("Small problems at D = 2 (2 x H200, runs 27-29). Blue: "
               "impl=auto takes the kernel; gray: NCCL + cuBLAS.\n"
               "Plain: all-gather (AG); hatched: reduce-scatter (RS). "
               "Above 1: the kernel is faster.", fontsize=10)
  fig.tight_layout()
  fig.savefig(os.path.join(HERE, "run27_29_small_problems.png"), dpi=110)


if __name__ == "__main__":
  main()
