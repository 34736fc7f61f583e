# Device call 1: k-major senders. Correctness tests first, then timings.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
t0=$SECONDS
timeout 230 python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py \
  -k "sender or every_config or balanced" > $OUT/tests_senders.log 2>&1
echo "== tests rc=$? $((SECONDS-t0))s"; tail -3 $OUT/tests_senders.log
B='python scripts/bench_kernels.py --skip-seed --rounds 5 --rs-shapes'
t0=$SECONDS
timeout 150 $B --shapes 1024/4096/4096:bf16 --config '{"sender_sms":4}' \
  --config '{"sender_sms":4,"k_major_sends":true}' --out $OUT/seed.json > $OUT/seed.log 2>&1
echo "== seed rc=$? $((SECONDS-t0))s"
t0=$SECONDS
timeout 120 $B --shapes 512/4096/4096:bf16 \
  --config '{"tile_n":64,"sender_sms":4,"k_major_sends":true}' --out $OUT/s512.json > $OUT/s512.log 2>&1
echo "== s512 rc=$? $((SECONDS-t0))s"
t0=$SECONDS
timeout 150 $B --shapes 2048/4096/4096:bf16 \
  --config '{"sender_sms":4,"k_major_sends":true}' --out $OUT/s2048.json > $OUT/s2048.log 2>&1
echo "== s2048 rc=$? $((SECONDS-t0))s"
python .scratch/diag/summarize.py $OUT/seed.json $OUT/s512.json $OUT/s2048.json
