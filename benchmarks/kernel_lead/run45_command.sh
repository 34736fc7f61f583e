# Device call 1 (run 45, one H200; x2 not lent): ping-pong warpgroups
# (`TileConfig.pingpong`): each compute warpgroup runs every other tile of
# its block, whole (128 x 128), on one chain of slots, so its epilogue runs
# under the other's k loop. GPU tests at D = 1 first, then the core against
# cuBLAS and today's configs, 3 rounds; then traces at k = 2048.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu_info.txt 2>&1
python -c "import jax; print(jax.__version__)" >> $OUT/gpu_info.txt 2>&1
timeout 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py tests/gpu/test_reduce_scatter_kernel.py -k "pingpong" > $OUT/tests.log 2>&1
rc=$?; echo "== tests rc=$rc"; tail -3 $OUT/tests.log
if [ $rc -ne 0 ]; then grep -E "FAILED|Error|error" $OUT/tests.log | head -20; fi
PP='"pingpong": true, "tile_m": 128, "tile_n": 128'
timeout 260 python scripts/bench_gemm_core.py --skip-upstream --iterations 20 --rounds 3 \
  --shapes 16384/2048/4096 16384/4096/6144 16384/5504/4096 2048/4096/4096 \
  --variant "pp6={$PP, \"eager_release\": true, \"max_concurrent_steps\": 6}" \
  --variant "pp4={$PP, \"eager_release\": true, \"max_concurrent_steps\": 4}" \
  --variant "rs_pp5={$PP, \"max_concurrent_steps\": 5, \"epi_tile_n\": 64}" \
  --out $OUT/core_pingpong.json > $OUT/core_pingpong.log 2>&1
echo "== bench rc=$?"; grep -v "^\s*$" $OUT/core_pingpong.log | grep -v "warn" | grep "medians\|!!\|failed\|error" | tail -30
mkdir -p $OUT/traces
timeout 120 python scripts/bench_gemm_core.py --skip-upstream --iterations 5 --rounds 1 \
  --shapes 16384/2048/4096 \
  --variant "pp5={$PP, \"eager_release\": true, \"max_concurrent_steps\": 5}" \
  --trace-dir $OUT/traces --out $OUT/core_pingpong_trace.json > $OUT/core_pingpong_trace.log 2>&1
echo "== trace rc=$?"; grep "trace\|failed\|!!" $OUT/core_pingpong_trace.log | tail -8
tar czf $OUT/traces.tgz -C $OUT traces && rm -rf $OUT/traces
