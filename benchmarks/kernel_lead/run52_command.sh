# Device call 9 (run 52, one H200): the GEMMs are power-bound (run 46), and
# DRAM traffic is the dearest energy per byte: the output tiles' order
# within a step (planar snake, `grid_tile_width` along `grid_minor_dim`)
# sets how much of A and B L2 serves. Width 4/16/32 and the n-minor snake
# against today's (m, 8), with today's tiles and with 64 x 256 warpgroup
# tiles. Predicted: within 1 %, unless a width cuts DRAM traffic.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv > $OUT/gpu_info.txt 2>&1
W='"tile_m": 64, "tile_n": 256, "wg_dimension": "m"'
timeout 420 python scripts/bench_gemm_core.py --skip-upstream --iterations 20 --rounds 3 \
  --shapes 16384/2048/4096 16384/5504/4096 2048/4096/4096 \
  --variant 'gw4={"grid_tile_width": 4}' \
  --variant 'gw16={"grid_tile_width": 16}' \
  --variant 'gw32={"grid_tile_width": 32}' \
  --variant 'gn8={"grid_minor_dim": "n"}' \
  --variant "w256={$W}" \
  --variant "w256gw16={$W, \"grid_tile_width\": 16}" \
  --variant "rs_w256={$W}" \
  --out $OUT/core_order.json > $OUT/core_order.log 2>&1
echo "== bench rc=$?"; grep -v "^\s*$" $OUT/core_order.log | grep -v "warn" | grep "!!\|failed\|error\||" | tail -20
