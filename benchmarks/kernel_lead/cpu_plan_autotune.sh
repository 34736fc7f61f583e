# Not a device run: every candidate of the autotune sweep, at 5 local shapes
# and D = 2, 4 and 8, traced and lowered for CUDA on CPU (`autotune.py
# --plan`, JAX 0.12.0.1, Python 3.12, CI's .ci-venv-312; eleventh session,
# commit 5c46f72). Only failures and the summaries are kept in the log.
export XLA_FLAGS=
for d in 2 4 8; do
  for pat in all_gather reduce_scatter; do
    echo "=== D=$d $pat"
    python scripts/autotune.py --plan $d --pattern $pat --shapes 1024/4096/4096 512/4096/4096 128/4096/2048 8192/4096/5504 2048/5504/4096 2>&1 | grep -v "^      " | grep -v " lowered$"
  done
done
