# Device call 6 (run 32): 2048/4096/4096, where ours was 0.5 % behind the
# example in run 31: the example's tile order (grid width 4) and send gaps,
# 7 rounds with the example in the rounds.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
A='"chain_tiles":true,"eager_release":true'
run s2048 200 python scripts/bench_kernels.py --rounds 7 --rs-shapes --shapes 2048/4096/4096:bf16 \
  --config "{$A,\"grid_tile_width\":4}" --config "{$A,\"send_gap\":8}" --config "{$A,\"send_gap\":16}" \
  --config "{$A,\"grid_tile_width\":4,\"send_gap\":16}"
python .scratch/diag/summarize.py $OUT/s2048.json
python -c "
import json; r=json.load(open('$OUT/s2048.json'))['rows'][0]
s=r['seed_rounds_us']
for k in [k for k in r if k.startswith('ours') and k.endswith('_rounds_us')]:
  print(k, [round(a/b,3) for a,b in zip(r[k],s)])"
grep -h "!!\|failed\|Error" $OUT/s2048.log | head -10
