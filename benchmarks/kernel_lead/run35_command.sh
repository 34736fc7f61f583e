# Device call 1 (run 35, one H200): the matmul core at k = 2048 (1.07 x
# cuBLAS in gemm_core run 1). How much is the last, partial wave (2048 tiles
# on 132 SMs = 15.5 waves) and how much a per-tile cost (k = 2048 against
# 4096 at the same tiles)? And does any tiling choice close it?
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
python -c "import jax; print(jax.__version__)" >> $OUT/gpu_info.txt 2>&1
timeout 280 python scripts/bench_gemm_core.py --shapes 16384/2048/4096 \
  --iterations 20 --rounds 3 \
  --variant 'epi128={"epi_tile_n": 128}' \
  --variant 'nochain={"chain_tiles": false}' \
  --variant 'w4={"grid_tile_width": 4}' \
  --variant 'w16={"grid_tile_width": 16}' \
  --variant 'minor_n={"grid_minor_dim": "n"}' \
  --variant 'wgm={"wg_dimension": "m"}' \
  --variant 'stages3={"max_concurrent_steps": 3, "chain_tiles": false}' \
  --out $OUT/core_variants.json > $OUT/core_variants.log 2>&1
echo "== variants rc=$?"; tail -16 $OUT/core_variants.log
timeout 250 python scripts/bench_gemm_core.py --skip-upstream --iterations 20 --rounds 3 \
  --shapes 15872/2048/4096 16896/2048/4096 16384/4096/4096 16896/4096/4096 15872/4096/4096 \
  --out $OUT/core_waves.json > $OUT/core_waves.log 2>&1
echo "== waves rc=$?"; tail -9 $OUT/core_waves.log
