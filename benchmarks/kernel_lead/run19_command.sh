# Device call 7: chained tiles with the balanced dedicated senders, 5 rounds.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
B='python scripts/bench_kernels.py --skip-seed --rounds 5 --rs-shapes'
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
run n5504 70 $B --shapes 8192/4096/5504:bf16 --config '{"tile_m":128,"tile_n":128,"wg_dimension":"m","sender_sms":4,"chain_tiles":true}'
run n6144 70 $B --shapes 8192/4096/6144:bf16 --config '{"sender_sms":4,"chain_tiles":true}'
run n2048 60 $B --shapes 8192/4096/2048:bf16 --config '{"eager_release":true,"chain_tiles":true}'
python .scratch/diag/summarize.py $OUT/n5504.json $OUT/n6144.json $OUT/n2048.json
