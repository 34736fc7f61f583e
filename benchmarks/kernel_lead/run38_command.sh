# Device call 4 (run 38, one H200): chained tiles at 3 stages
# (`_OffsetChain`: k steps no multiple of the depth), for the
# reduce-scatter's config (3 stages, whole-tile epilogue) and the
# all-gather's. Run 36/37's traces put ~1500 cycles per tile in the
# unchained reduce-scatter's pipeline fill. GPU tests at D = 1 first.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu_info.txt 2>&1
python -c "import jax; print(jax.__version__)" >> $OUT/gpu_info.txt 2>&1
timeout 240 python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py tests/gpu/test_reduce_scatter_kernel.py -k "every_config or schedules_are_exact" > $OUT/tests.log 2>&1
rc=$?; echo "== tests rc=$rc"; tail -3 $OUT/tests.log
if [ $rc -ne 0 ]; then grep -E "FAILED|Error" $OUT/tests.log | head -20; exit 1; fi
mkdir -p $OUT/traces
timeout 300 python scripts/bench_gemm_core.py --skip-upstream --iterations 20 --rounds 3 \
  --shapes 16384/2048/4096 16384/4096/2048 16384/5504/4096 2048/4096/4096 \
  --variant 'rs_chain={"chain_tiles": true}' \
  --variant 'stages3_chain={"max_concurrent_steps": 3}' \
  --trace-dir $OUT/traces --out $OUT/core_chain3.json > $OUT/core_chain3.log 2>&1
echo "== bench rc=$?"; grep -v "^\s*$" $OUT/core_chain3.log | grep -v "warn" | grep "medians\|trace:\|!!\|failed\||" | tail -30
tar czf $OUT/traces.tgz -C $OUT traces && rm -rf $OUT/traces
