# Device call 3 (run 47, one H200): run 46 showed every core GEMM at the
# 700 W cap (SW power cap, 1430-1670 MHz): time is energy. Warpgroup tiles
# of 64 x 256 (one m64n256k16 wgmma per k16 instead of two m64n128k16,
# reading B from shared memory once, not twice: 17 % fewer operand bytes per
# flop) in the same 128 x 256 CTA tile (split on m). Predicted: a higher
# clock at the cap, 1-3 % faster at every shape.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv > $OUT/gpu_info.txt 2>&1
python -c "import jax; print(jax.__version__)" >> $OUT/gpu_info.txt 2>&1
W='"tile_m": 64, "tile_n": 256, "wg_dimension": "m"'
timeout 500 python scripts/bench_gemm_core.py --skip-upstream --iterations 20 --rounds 3 --power-seconds 1.5 \
  --shapes 16384/2048/4096 16384/4096/2048 16384/4096/6144 16384/5504/4096 2048/4096/4096 \
  --variant "w256={$W}" \
  --variant "w256s3={$W, \"max_concurrent_steps\": 3, \"chain_tiles\": true}" \
  --variant "rs_w256={$W}" \
  --variant "rs_w256c={$W, \"chain_tiles\": true}" \
  --out $OUT/core_w256.json > $OUT/core_w256.log 2>&1
echo "== bench rc=$?"; grep -v "^\s*$" $OUT/core_w256.log | grep -v "warn" | grep "medians\|!!\|failed\|error\|sustained\||" | tail -50
