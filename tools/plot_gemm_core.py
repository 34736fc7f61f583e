"""Plot bench_gemm_core.py JSON: each of our cores against its cuBLAS GEMM,
per shape, with the targets (issue 47's).

Bars per shape: `ours_ag / cublas` and `ours_rs / cublas` (bf16), `ours_fp8
/ cublas_fp8` (all-gather core, e4m3 x e4m3) and `ours_fp8_rs /
cublas_fp8` (reduce-scatter core, e5m2 x e4m3), then each `--variant`
arm (`ours_NAME`, against `cublas_fp8` where NAME has fp8, else
`cublas`), where a row has both times; the legend gives each ratio's
geomean. Where an arm's `*_kernels` show work outside our Mosaic GPU kernel
(operands padded to the tile, the output sliced back: a tile that does
not divide the shape), that part of its bar is hatched. Lines: the
geomean targets
(bf16 1.01, fp8 1.03) and no shape over 1.06 (fp8). Rows of several files
(one call's shapes split over calls) are merged by shape, later files
replacing earlier ones.

  python tools/plot_gemm_core.py benchmarks/core_one_gpu/fp8_picks.json \
      benchmarks/core_one_gpu/fp8_picks_n14336.json \
      benchmarks/core_one_gpu/fp8_picks.png
"""
from __future__ import annotations

import argparse
import json
import math

# (numerator, denominator, label) of each ratio drawn.
RATIOS = [("ours_ag", "cublas", "bf16 all-gather core / cuBLAS"),
          ("ours_rs", "cublas", "bf16 reduce-scatter core / cuBLAS"),
          ("ours_fp8", "cublas_fp8", "fp8 all-gather core / cuBLASLt fp8"),
          ("ours_fp8_rs", "cublas_fp8",
           "fp8 reduce-scatter core / cuBLASLt fp8")]
# The targets (issue 47's): (value, label), drawn where a ratio of that
# dtype is.
TARGETS = [(1.01, "bf16 geomean target"), (1.03, "fp8 geomean target"),
           (1.06, "fp8: no shape over")]


def merged_rows(paths):
  """The rows of bench_gemm_core JSON files by shape (later files win),
  in first-seen order, and the first file's `meta`."""
  rows, meta = {}, None
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    meta = meta or data.get("meta", {})
    for row in data["rows"]:
      rows[row["shape"]] = row
  return list(rows.values()), meta


def _variants(rows):
  """(numerator, denominator, label) of the `--variant` arms the rows
  have: `ours_*` times other than `RATIOS`' and the fp8 forward's."""
  fixed = {num for num, _, _ in RATIOS} | {"ours_fp8_fwd"}
  names = []
  for r in rows:
    for key in r:
      name = key[:-len("_us")]
      if (key.endswith("_us") and not key.endswith("_rounds_us")
          and name.startswith("ours_") and name not in fixed
          and name not in names):
        names.append(name)
  return [(name, "cublas_fp8" if "fp8" in name else "cublas",
           f"{name} / {'cuBLASLt fp8' if 'fp8' in name else 'cuBLAS'}")
          for name in names]


def ratios(rows):
  """{label: [ratio or None per row]} of the `RATIOS` and variants some
  row has."""
  out = {}
  for num, den, label in RATIOS + _variants(rows):
    values = [r[f"{num}_us"] / r[f"{den}_us"]
              if r.get(f"{num}_us") and r.get(f"{den}_us") else None
              for r in rows]
    if any(v is not None for v in values):
      out[label] = values
  return out


def kernel_share(row, name):
  """The share of arm `name`'s kernel time in `row` spent in our Mosaic
  GPU kernel (1.0 when it ran alone), from the CUPTI per-kernel times of
  `{name}_kernels`; None without them."""
  kernels = row.get(f"{name}_kernels")
  if not kernels:
    return None
  ours = sum(us for kernel, us in kernels.items() if "mosaic" in kernel)
  return ours / sum(kernels.values())


def shares(rows):
  """{label: [kernel share or None per row]} of the drawn ratios."""
  return {label: [kernel_share(r, num) for r in rows]
          for num, _, label in RATIOS + _variants(rows)}


def geomean(values):
  present = [v for v in values if v is not None]
  return math.exp(sum(map(math.log, present)) / len(present))


def main(srcs, dst):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows, meta = merged_rows(srcs)
  drawn = ratios(rows)
  inside = shares(rows)
  if not drawn:
    raise SystemExit(f"{', '.join(srcs)}: no row has both times of any of "
                     + ", ".join(f"{n}/{d}" for n, d, _ in RATIOS))
  width = 0.8 / len(drawn)
  hatched = False
  fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows)),
                                  5.5 + 0.25 * (len(drawn) + 1) // 2))
  for i, (label, values) in enumerate(drawn.items()):
    xs = [j + (i - len(drawn) / 2 + 0.5) * width for j in range(len(rows))]
    heights = [v if v is not None else 0 for v in values]
    ax.bar(xs, heights, width,
           label=f"{label} (geomean {geomean(values):.3f})",
           color=f"C{i}")
    outside = [h * (1 - share) if share is not None else 0
               for h, share in zip(heights, inside[label])]
    if any(o > 0 for o in outside):
      ax.bar(xs, outside, width, bottom=[h - o for h, o in
                                         zip(heights, outside)],
             color="none", edgecolor="k", hatch="///", lw=0)
      hatched = True
  kinds = {"fp8" if "fp8" in label else "bf16" for label in drawn}
  ax.axhline(1.0, color="k", lw=0.8)  # cuBLAS's time.
  for value, label in TARGETS:
    if label.split(" ")[0].rstrip(":") not in kinds:
      continue
    ax.axhline(value, color="k", lw=0.8, ls=":")
    ax.annotate(label, (len(rows) - 0.5, value), fontsize=7, ha="right",
                va="bottom")
  if hatched:
    ax.bar([0], [0], color="none", edgecolor="k", hatch="///", lw=0,
           label="hatched: padding and slicing outside our kernel")
  ax.set_xticks(range(len(rows)), [r["shape"] for r in rows], fontsize=8,
                rotation=20)
  ax.set_xlabel("M/K/N (the whole GEMM on one GPU)")
  ax.set_ylabel("time / cuBLAS's (lower is better)")
  highest = max(v for values in drawn.values() for v in values if v)
  ax.set_ylim(0.9, max(1.15, highest + 0.02))
  ax.set_title(f"Our matmul cores against cuBLAS, {meta.get('device', '?')}, "
               f"jax {meta.get('jax', '?')}")
  ax.legend(fontsize=8, ncol=2, loc="upper center",
            bbox_to_anchor=(0.5, -0.2))
  fig.tight_layout()
  fig.savefig(dst, dpi=110)
  print("wrote", dst)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("src", nargs="+",
                      help="JSON written by tools/bench_gemm_core.py")
  parser.add_argument("dst", help="PNG to write")
  args = parser.parse_args()
  main(args.src, args.dst)
