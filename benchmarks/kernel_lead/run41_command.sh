# Device call 7 (run 41, 2 x H200): the reduce-scatter's two ring steps
# interleaved (`step_lead_waves`), against the picked configs, 3 rounds,
# with warpgroup traces (run 40's traces: at 8192/2048/4096 the step-0
# epilogues wait ~8.5 k cycles each for the previous partial sum's sends).
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu_info.txt 2>&1
timeout 120 python -m pytest -q -p no:cacheprovider tests/gpu/test_reduce_scatter_kernel.py -k interleaved > $OUT/tests.log 2>&1
rc=$?; echo "== tests rc=$rc"; tail -2 $OUT/tests.log
if [ $rc -ne 0 ]; then grep -E "FAILED|Error" $OUT/tests.log | head -20; exit 1; fi
mkdir -p $OUT/traces
timeout 420 python scripts/bench_kernels.py --shapes --rounds 3 --iterations 10 \
  --rs-shapes 8192/2048/4096 8192/4096/2048 8192/5504/4096 4096/7168/8192 \
  --rs-config '{"selected": true, "step_lead_waves": 1}' \
  --rs-config '{"selected": true, "step_lead_waves": 2}' \
  --rs-config '{"selected": true, "step_lead_waves": 1, "chain_tiles": true}' \
  --trace-dir $OUT/traces --out $OUT/rs_interleave.json > $OUT/rs_interleave.log 2>&1
echo "== bench rc=$?"; grep "trace:\|failed" $OUT/rs_interleave.log | cut -c1-330
python - <<'PY'
import json, os
rows = json.load(open(os.environ["OUT"] + "/rs_interleave.json"))["rows"]
keys = ["ours", "ours_cfg1", "ours_cfg2", "ours_cfg3"]
print("| shape | bound | nccl | picked | lead 1 | lead 2 | lead 1 + chain |")
for r in rows:
  print(f"| {r['shape']} | {r['bound_us']:.1f} | {r['nccl_us']:.1f} | " + " | ".join(f"{r.get(k + '_us', 0):.1f}" for k in keys) + " |")
  print("   errs", [f"{r.get(k + '_rel_err', -1):.1e}" for k in keys], "repeat", [r.get(k + "_repeat_identical") for k in keys])
  print("   rounds", {k: [round(x, 1) for x in r.get(k + "_rounds_us", [])] for k in keys})
PY
tar czf $OUT/traces.tgz -C $OUT traces && rm -rf $OUT/traces
