# Device call 5 (run 39, 2 x H200): the 3-stage chained pipeline
# (`_OffsetChain`) in the reduce-scatter ring: exactness at D = 2 (GPU
# tests, with the traced kernels), then the picked reduce-scatter configs
# against the same with chain_tiles, side by side, 3 rounds.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu_info.txt 2>&1
python -c "import jax; print(jax.__version__, jax.devices())" >> $OUT/gpu_info.txt 2>&1
timeout 100 python -m pytest -q -p no:cacheprovider tests/gpu/test_kernel_traces.py > $OUT/tests.log 2>&1
rc=$?; echo "== tests rc=$rc"; tail -3 $OUT/tests.log
if [ $rc -ne 0 ]; then grep -E "FAILED|Error" $OUT/tests.log | head -20; exit 1; fi
timeout 320 python scripts/bench_kernels.py --shapes --rounds 3 --iterations 10 \
  --rs-shapes 1024/4096/4096 512/4096/4096 8192/2048/4096 8192/5504/4096 8192/4096/2048 \
  --rs-config '{"selected": true, "chain_tiles": true}' \
  --out $OUT/rs_chain.json > $OUT/rs_chain.log 2>&1
echo "== bench rc=$?"
python - <<'PY'
import json, os
rows = json.load(open(os.environ["OUT"] + "/rs_chain.json"))["rows"]
print("| shape | bound | nccl | picked | chained | chained/picked | errs | repeat |")
for r in rows:
  print(f"| {r['shape']} | {r['bound_us']:.1f} | {r['nccl_us']:.1f} | {r.get('ours_us', 0):.1f} | {r.get('ours_cfg1_us', 0):.1f} | {r.get('ours_cfg1_us', 0) / r.get('ours_us', 1):.3f} | {r.get('ours_rel_err', -1):.1e}/{r.get('ours_cfg1_rel_err', -1):.1e} | {r.get('ours_repeat_identical')}/{r.get('ours_cfg1_repeat_identical')} |")
  print("   rounds picked", [round(x, 1) for x in r.get("ours_rounds_us", [])], "chained", [round(x, 1) for x in r.get("ours_cfg1_rounds_us", [])])
PY
