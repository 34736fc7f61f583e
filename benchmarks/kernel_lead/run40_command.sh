# Device call 6 (run 40, 2 x H200): warpgroup traces of the rings (picked
# configs): where a block's cycles go per tile (k loop, epilogue, waits for
# the shard / the partial sum) at the seed shape, 2048/4096/4096 (0.7 %
# behind the example) and the reduce-scatter at 1024 and 8192/2048/4096.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu_info.txt 2>&1
mkdir -p $OUT/traces
timeout 400 python scripts/bench_kernels.py --skip-seed --iterations 10 \
  --shapes 1024/4096/4096:bf16 2048/4096/4096:bf16 512/4096/4096:bf16 \
  --rs-shapes 1024/4096/4096 8192/2048/4096 512/4096/4096 \
  --trace-dir $OUT/traces --out $OUT/ring_traces.json > $OUT/ring_traces.log 2>&1
echo "== bench rc=$?"; grep "trace:\|failed" $OUT/ring_traces.log | cut -c1-400
grep -A12 "^pattern" $OUT/ring_traces.log
tar czf $OUT/traces.tgz -C $OUT traces && rm -rf $OUT/traces
