# Device call 8 (run 42, 2 x H200): (1) f16 operands at small problems
# inside `selection.SMALL_BOXES` (measured in bf16 only, runs 27-29): does
# auto's kernel beat NCCL + cuBLAS there in f16 too? (2) the all-gather at
# 8192/5504/4096 (86 k steps, no multiple of 4: not chained today) with
# chain_tiles through `_OffsetChain`.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu_info.txt 2>&1
timeout 260 python scripts/bench_kernels.py --skip-seed --rounds 3 --iterations 10 \
  --shapes 128/4096/2048:f16 256/4096/4096:f16 384/4096/2048:f16 512/4096/4096:f16 \
  --rs-shapes 256/4096/4096:f16 512/2048/4096:f16 256/1024/2048:f16 \
  --out $OUT/f16_small.json > $OUT/f16_small.log 2>&1
echo "== f16 rc=$?"; grep -A10 "^pattern" $OUT/f16_small.log
timeout 200 python scripts/bench_kernels.py --skip-seed --rounds 3 --iterations 10 \
  --shapes 8192/5504/4096:bf16 --rs-shapes \
  --config '{"selected": true, "chain_tiles": true}' \
  --out $OUT/ag_chain_5504.json > $OUT/ag_chain_5504.log 2>&1
echo "== ag chain rc=$?"
python - <<'PY'
import json, os
for f in ("f16_small", "ag_chain_5504"):
  try:
    rows = json.load(open(os.environ["OUT"] + f"/{f}.json"))["rows"]
  except Exception as e:
    print(f, e); continue
  for r in rows:
    ks = [k[:-3] for k in r if k.startswith("ours") and k.endswith("_us")]
    print(f, r.get("pattern", "all_gather"), r["shape"], r["dtype"], "bound", round(r["bound_us"], 1), "nccl", round(r["nccl_us"], 1),
          {k: (round(r[k + "_us"], 1), f"{r.get(k + '_rel_err', -1):.1e}", r.get(k + "_repeat_identical"), [round(x, 1) for x in r.get(k + "_rounds_us", [])]) for k in ks})
PY
