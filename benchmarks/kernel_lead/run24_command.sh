# Device call 4 (run 24): the final code (k-major senders announce at once
# by default): GPU tests of every config and of the sender blocks at D = 2,
# the seed shape's selection against the f32 reference; issue 13's shapes
# side by side, 7 rounds, the example included; 512 rows with wider sender
# chunks (tile_k 128).
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
t0=$SECONDS
timeout 170 python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py \
  -k "every_config or (sender and 2-) or (matches_f32 and bfloat16-1024-4096-4096-2)" > $OUT/tests.log 2>&1
echo "== tests rc=$? $((SECONDS-t0))s"; tail -2 $OUT/tests.log
run headline 250 python scripts/bench_kernels.py --rounds 7 --shapes 1024/4096/4096:bf16 1024/4096/4096:f16 \
  512/4096/4096:bf16 --rs-shapes 1024/4096/4096:bf16 512/4096/4096:bf16
grep -A12 "^pattern" $OUT/headline.log
KM='"sender_sms":4,"k_major_sends":true'
run wide 90 python scripts/bench_kernels.py --skip-seed --rounds 5 --rs-shapes --shapes 512/4096/4096:bf16 \
  --config "{\"tile_n\":64,\"tile_k\":128,\"max_concurrent_steps\":3,$KM}" \
  --config "{\"tile_n\":64,\"tile_k\":128,\"max_concurrent_steps\":2,$KM}"
python .scratch/diag/summarize.py $OUT/headline.json $OUT/wide.json
