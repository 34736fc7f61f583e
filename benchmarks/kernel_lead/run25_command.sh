# Device call 5 (run 25): the final code (auto takes 128-column k steps for
# the k-major senders where all ring steps are one wave): GPU tests of
# every config, the sender blocks at D = 2, the seed shape's selection and
# the new 512-row selection against the f32 reference; 512/4096/4096 side
# by side (auto, the previous tile_k 64 config, the example, NCCL + cuBLAS);
# the reduce-scatter at 512 rows with 128-column k steps (3 stages).
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
KM='"sender_sms":4,"k_major_sends":true'
run s512 110 python scripts/bench_kernels.py --rounds 5 --rs-shapes --shapes 512/4096/4096:bf16 \
  --config "{\"tile_n\":64,$KM}"
t0=$SECONDS
timeout 260 python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py \
  -k "every_config or (sender and 2-) or (matches_f32 and bfloat16-1024-4096-4096-2) or wide_sender" > $OUT/tests.log 2>&1
echo "== tests rc=$? $((SECONDS-t0))s"; tail -3 $OUT/tests.log
RSW='"tile_n":64,"tile_k":128,"max_concurrent_steps":3,"send_pieces":4'
run rswide 70 python scripts/bench_kernels.py --skip-seed --rounds 5 --shapes --rs-shapes 512/4096/4096:bf16 \
  --rs-config "{$RSW,\"send_gap\":3}" --rs-config "{$RSW,\"send_gap\":6}"
python .scratch/diag/summarize.py $OUT/s512.json $OUT/rswide.json
