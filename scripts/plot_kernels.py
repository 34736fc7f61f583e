"""Plot a bench_kernels.py JSON: time per method per shape, relative to the bound.

  python scripts/plot_kernels.py benchmarks/raw_kernels_h200x2.json \
      benchmarks/kernels_h200x2.png
"""
import json
import sys

METHODS = [("bound", "D x local cuBLAS (bound)"), ("ours", "ours"),
           ("seed", "seed example kernel"), ("nccl", "NCCL collective + cuBLAS"),
           ("windowed", "XLA windowed einsum (wall)")]


def main(src, dst):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  with open(src) as f:
    data = json.load(f)
  rows = data["rows"]
  present = [m for m in METHODS if any(r.get(f"{m[0]}_us") for r in rows)]
  labels = [f"{r['shape']}\n{r['dtype']}" for r in rows]
  x = np.arange(len(rows))
  width = 0.8 / len(present)
  fig, ax = plt.subplots(figsize=(12, 5.5))
  for i, (key, name) in enumerate(present):
    vals = [(r.get(f"{key}_us") or np.nan) / r["bound_us"] for r in rows]
    color = f"C{[m[0] for m in METHODS].index(key)}"  # Same colour per method.
    ax.bar(x + (i - len(present) / 2 + 0.5) * width, vals, width, label=name,
           color=color)
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_xticks(x, labels, fontsize=8)
  ax.set_ylabel("time / bound (lower is better)")
  ax.set_ylim(0, 2.0)
  pattern = rows[0].get("pattern", "all_gather")
  what = ("Matmul + reduce-scatter" if pattern == "reduce_scatter"
          else "All-gather matmul")
  ax.set_title(f"{what}, D={rows[0]['D']}, "
               f"{data['versions']['devices'][0]}, jax {data['versions']['jax']}"
               " (windowed einsum clipped at 2x)")
  ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.12))
  fig.tight_layout()
  fig.savefig(dst, dpi=110)
  print("wrote", dst)


if __name__ == "__main__":
  main(*sys.argv[1:3])
