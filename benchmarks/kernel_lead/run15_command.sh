# Device call 3: k-major senders with the tiles sending the last groups,
# eager release; then the all-gather GPU test file.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
B='python scripts/bench_kernels.py --skip-seed --rounds 5 --rs-shapes'
KM='"sender_sms":4,"k_major_sends":true'
t0=$SECONDS
timeout 120 $B --shapes 1024/4096/4096:bf16 --config '{"eager_release":true}' --config "{$KM}" \
  --config "{$KM,\"tiles_send_last_groups\":1}" --config "{$KM,\"tiles_send_last_groups\":2}" \
  --config "{$KM,\"tiles_send_last_groups\":4}" --out $OUT/seed.json > $OUT/seed.log 2>&1
echo "== seed rc=$? $((SECONDS-t0))s"
t0=$SECONDS
timeout 120 $B --shapes 512/4096/4096:bf16 --config "{\"tile_n\":64,$KM}" \
  --config "{\"tile_n\":64,$KM,\"tiles_send_last_groups\":1}" --config "{\"tile_n\":64,$KM,\"tiles_send_last_groups\":2}" \
  --config "{\"tile_n\":64,$KM,\"tiles_send_last_groups\":4}" --config '{"tile_n":64,"eager_release":true}' \
  --out $OUT/s512.json > $OUT/s512.log 2>&1
echo "== s512 rc=$? $((SECONDS-t0))s"
t0=$SECONDS
timeout 100 $B --shapes 2048/4096/4096:bf16 --config '{"eager_release":true}' \
  --config "{$KM,\"tiles_send_last_groups\":6}" --out $OUT/s2048.json > $OUT/s2048.log 2>&1
echo "== s2048 rc=$? $((SECONDS-t0))s"
python .scratch/diag/summarize.py $OUT/seed.json $OUT/s512.json $OUT/s2048.json
t0=$SECONDS
timeout $((570 - SECONDS)) python -m pytest -q -p no:cacheprovider -x tests/gpu/test_all_gather_kernel.py \
  > $OUT/tests_ag.log 2>&1
echo "== tests rc=$? $((SECONDS-t0))s"; tail -4 $OUT/tests_ag.log
