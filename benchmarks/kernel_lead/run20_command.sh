# Device call 8: the final code (tiles' tail sends removed, selection's
# chained tiles): GPU tests of every config and the senders at the seed
# shape; `auto`'s choices at the seed shape and 8192/4096/2048.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
t0=$SECONDS
timeout 120 python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py \
  -k "every_config or (sender and 1024-4096-4096-2) or (matches_f32 and bfloat16-1024-4096-4096-2)" > $OUT/tests.log 2>&1
echo "== tests rc=$? $((SECONDS-t0))s"; tail -2 $OUT/tests.log
t0=$SECONDS
timeout 60 python scripts/bench_kernels.py --skip-seed --rounds 3 --rs-shapes --shapes 1024/4096/4096:bf16 \
  8192/4096/2048:bf16 --out $OUT/auto.json > $OUT/auto.log 2>&1
echo "== auto rc=$? $((SECONDS-t0))s"
python .scratch/diag/summarize.py $OUT/auto.json
