# Device call 7 (run 50, one H200): after the wgmma race fix, `_OffsetChain`
# waits for its step's wgmmas and frees the slot at once (as JAX's pipeline);
# run 49's deferred release cost 10-15 % at 3 stages. GPU tests at D = 1
# (every config, with 64 x 256 warpgroup tiles and ping-pong), then the core:
# today's configs, 3 stages chained, 64 x 256 warpgroup tiles, ping-pong.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv > $OUT/gpu_info.txt 2>&1
timeout 230 python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py tests/gpu/test_reduce_scatter_kernel.py tests/gpu/test_kernel_traces.py -k "every_config or schedules_are_exact or float32 or traced" > $OUT/tests.log 2>&1
rc=$?; echo "== tests rc=$rc"; tail -3 $OUT/tests.log
if [ $rc -ne 0 ]; then grep -E "FAILED|Error" $OUT/tests.log | head -20; fi
W='"tile_m": 64, "tile_n": 256, "wg_dimension": "m"'
PP='"pingpong": true, "tile_m": 128, "tile_n": 128, "eager_release": true'
timeout 330 python scripts/bench_gemm_core.py --skip-upstream --iterations 20 --rounds 3 \
  --shapes 16384/2048/4096 16384/4096/2048 16384/4096/6144 16384/5504/4096 2048/4096/4096 \
  --variant "s3={\"max_concurrent_steps\": 3, \"chain_tiles\": true}" \
  --variant "w256={$W}" \
  --variant "w256c={$W, \"chain_tiles\": true}" \
  --variant "rs_w256={$W}" \
  --variant "pp6={$PP, \"max_concurrent_steps\": 6}" \
  --out $OUT/core_fixed2.json > $OUT/core_fixed2.log 2>&1
echo "== bench rc=$?"; grep -v "^\s*$" $OUT/core_fixed2.log | grep -v "warn" | grep "!!\|failed\|error\||" | tail -20
