# Device call 2: where the k-major senders' time goes (loopback), the spread
# sends with 128 x 128 tiles at 512 rows, and k-major at f16 and a large shape.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
B='python scripts/bench_kernels.py --rounds 5 --rs-shapes'
KM='"sender_sms":4,"k_major_sends":true'
t0=$SECONDS
timeout 200 $B --shapes 1024/4096/4096:bf16 --config "{$KM}" --config "{$KM,\"loopback\":true}" \
  --config '{"loopback":true}' --out $OUT/seed.json > $OUT/seed.log 2>&1
echo "== seed rc=$? $((SECONDS-t0))s"
t0=$SECONDS
timeout 150 $B --skip-seed --shapes 512/4096/4096:bf16 --config '{"tile_n":64}' \
  --config '{"tile_n":64,"send_gap":4}' --config "{\"tile_n\":64,$KM}" \
  --config "{\"tile_n\":64,$KM,\"loopback\":true}" --config '{"tile_n":64,"sender_sms":4,"loopback":true}' \
  --out $OUT/s512.json > $OUT/s512.log 2>&1
echo "== s512 rc=$? $((SECONDS-t0))s"
t0=$SECONDS
timeout 120 $B --skip-seed --shapes 1024/4096/4096:f16 --config "{$KM}" --out $OUT/f16.json > $OUT/f16.log 2>&1
echo "== f16 rc=$? $((SECONDS-t0))s"
t0=$SECONDS
timeout 150 python scripts/bench_kernels.py --rounds 3 --rs-shapes --skip-seed --shapes 4096/8192/7168:bf16 \
  --config "{$KM}" --out $OUT/large.json > $OUT/large.log 2>&1
echo "== large rc=$? $((SECONDS-t0))s"
python .scratch/diag/summarize.py $OUT/seed.json $OUT/s512.json $OUT/f16.json $OUT/large.json
