# Device call 10 (run 53, one H200): 64 x 256 warpgroup tiles at more
# shapes (k = 4096 and 14336, n = 14336, and smaller M), with a 64 x 128
# epilogue tile (half the TMA stores) as a variant. Predicted: level to
# 1 % faster everywhere, as in runs 50 and 52.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv > $OUT/gpu_info.txt 2>&1
python -c "import jax; print('jax', jax.__version__)" >> $OUT/gpu_info.txt 2>&1
W='"tile_m": 64, "tile_n": 256, "wg_dimension": "m"'
timeout 420 python scripts/bench_gemm_core.py --skip-upstream --iterations 20 --rounds 3 \
  --shapes 16384/4096/4096 16384/4096/14336 16384/14336/4096 8192/4096/4096 4096/4096/4096 \
  --variant "w256={$W}" \
  --variant "w256e128={$W, \"epi_tile_n\": 128}" \
  --variant "rs_w256={$W}" \
  --out $OUT/core_w256_more.json > $OUT/core_w256_more.log 2>&1
echo "== bench rc=$?"; grep -v "^\s*$" $OUT/core_w256_more.log | grep -v "warn" | grep "!!\|failed\|error\||" | tail -20
