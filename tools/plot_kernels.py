"""Plot a bench_kernels.py JSON: time per method per shape, relative to the bound.

  python tools/plot_kernels.py benchmarks/rings_h200x2/ag_all_shapes.json \
      kernels.png
"""
import json

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
  patterns = {r.get("pattern", "all_gather") for r in rows}
  short = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}
  labels = [f"{r['shape']}\n{r['dtype']}" + (
      f" {short[r.get('pattern', 'all_gather')]}" if len(patterns) > 1 else "")
            for r in rows]
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
  what = " and ".join(
      "matmul + reduce-scatter" if p == "reduce_scatter" else "all-gather matmul"
      for p in sorted(patterns))
  clipped = (" (windowed einsum clipped at 2x)"
             if any(r.get("windowed_us") for r in rows) else "")
  ax.set_title(f"{what[0].upper() + what[1:]}, D={rows[0]['D']}, "
               f"{data['versions']['devices'][0]}, jax {data['versions']['jax']}"
               + clipped)
  ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.12))
  fig.tight_layout()
  fig.savefig(dst, dpi=110)
  print("wrote", dst)


if __name__ == "__main__":
  import argparse
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("src", help="JSON written by tools/bench_kernels.py")
  parser.add_argument("dst", help="PNG to write")
  args = parser.parse_args()
  main(args.src, args.dst)
