# Device call 2 (run 36, one H200): warpgroup traces of the matmul core
# (kernels.trace_warpgroups): where a block's time goes per tile (k loop,
# epilogue, the gap between tiles) at k = 2048 and at the seed's GEMM; and
# the GPU test of the traced kernels (D = 1 here).
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu_info.txt 2>&1
python -c "import jax; print(jax.__version__)" >> $OUT/gpu_info.txt 2>&1
timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_kernel_traces.py > $OUT/tests.log 2>&1
echo "== tests rc=$?"; tail -3 $OUT/tests.log
mkdir -p $OUT/traces
timeout 300 python scripts/bench_gemm_core.py --skip-upstream --iterations 10 \
  --shapes 16384/2048/4096 16896/2048/4096 2048/4096/4096 \
  --variant 'nochain={"chain_tiles": false}' \
  --trace-dir $OUT/traces --out $OUT/core_traces.json > $OUT/core_traces.log 2>&1
echo "== traces rc=$?"; grep -v "^\s*$" $OUT/core_traces.log | tail -20
nvidia-smi --query-gpu=clocks.sm --format=csv >> $OUT/gpu_info.txt 2>&1
tar czf $OUT/traces.tgz -C $OUT traces && rm -rf $OUT/traces
ls -la $OUT
