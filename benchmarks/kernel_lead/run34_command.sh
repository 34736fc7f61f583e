# Device call 8 (run 34, one H200: x2 was no longer lent): the matmul core
# alone at 2048/4096/4096's whole GEMM (4096 x 4096 x 4096), ours against
# JAX's hopper matmul with the same tiles and cuBLAS: is the 0.7-1.6 % the
# all-gather loses to the example there in the core or in the ring?
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
for i in 1 2 3; do
  timeout 80 python scripts/bench_gemm_core.py --shapes 4096/4096/4096 --iterations 20 --out $OUT/core$i.json > $OUT/core$i.log 2>&1
  echo "== core$i rc=$?"; grep "us  err" $OUT/core$i.log
done
