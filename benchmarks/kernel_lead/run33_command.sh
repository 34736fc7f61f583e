# Device call 7 (run 33): 2048/4096/4096, the untried variants of run 32's
# "Next": the tiles' sends unchained (eager or late release) in the
# example's tile order, and by-rows senders with 128 x 256 and 128 x 128
# tiles, 7 rounds with the example in the rounds.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
run s2048 200 python scripts/bench_kernels.py --rounds 7 --rs-shapes --shapes 2048/4096/4096:bf16 \
  --config '{"grid_tile_width":4}' --config '{"grid_tile_width":4,"eager_release":true}' \
  --config '{"sender_sms":4,"chain_tiles":true}' --config '{"sender_sms":4,"chain_tiles":true,"tile_n":64}'
python .scratch/diag/summarize.py $OUT/s2048.json
python -c "
import json,statistics; r=json.load(open('$OUT/s2048.json'))['rows'][0]
s=r['seed_rounds_us']
for k in [k for k in r if k.startswith('ours') and k.endswith('_rounds_us')]:
  q=[round(a/b,3) for a,b in zip(r[k],s)]; print(k, q, 'median', statistics.median(q))"
grep -h "!!\|failed\|Error" $OUT/s2048.log | head -10
