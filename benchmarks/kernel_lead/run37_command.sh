# Device call 3 (run 37, one H200): the epilogue straight from registers
# into the output (`direct_epilogue`), against the shared-memory slots and
# TMA stores, in the core at k = 2048 and at model shapes; traced to see
# the epilogue's cycles. GPU tests of the new configs at D = 1.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu_info.txt 2>&1
python -c "import jax; print(jax.__version__)" >> $OUT/gpu_info.txt 2>&1
timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py tests/gpu/test_kernel_traces.py -k "every_config or traced" > $OUT/tests.log 2>&1
echo "== tests rc=$?"; tail -3 $OUT/tests.log
mkdir -p $OUT/traces
timeout 330 python scripts/bench_gemm_core.py --skip-upstream --iterations 20 --rounds 3 \
  --shapes 16384/2048/4096 16896/2048/4096 16384/4096/2048 16384/4096/6144 2048/4096/4096 \
  --variant 'direct={"direct_epilogue": true}' \
  --trace-dir $OUT/traces --out $OUT/core_direct.json > $OUT/core_direct.log 2>&1
echo "== bench rc=$?"; grep -v "^\s*$" $OUT/core_direct.log | grep -v "warn" | grep "medians\|trace:\|!!\|failed\||" | tail -30
tar czf $OUT/traces.tgz -C $OUT traces && rm -rf $OUT/traces
