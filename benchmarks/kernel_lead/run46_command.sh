# Device call 2 (run 46, one H200): are the core GEMMs power-bound? Run 45:
# ping-pong spends ~7 % fewer cycles per block than the cooperative tiles
# at 16384/2048/4096 (514 k against 553 k), but is not faster: its cycles
# over its time imply a ~9 % lower clock. Each method back to back for 2 s
# while nvidia-smi samples clock and power (`--power-seconds`).
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit,enforced.power.limit --format=csv > $OUT/gpu_info.txt 2>&1
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader,nounits >> $OUT/gpu_info.txt 2>&1
python -c "import jax; print(jax.__version__)" >> $OUT/gpu_info.txt 2>&1
cat $OUT/gpu_info.txt
PP='"pingpong": true, "tile_m": 128, "tile_n": 128'
timeout 400 python scripts/bench_gemm_core.py --iterations 20 --rounds 3 --power-seconds 2 \
  --shapes 16384/2048/4096 16384/5504/4096 2048/4096/4096 \
  --variant "pp6={$PP, \"eager_release\": true, \"max_concurrent_steps\": 6}" \
  --variant "rs_pp5={$PP, \"max_concurrent_steps\": 5, \"epi_tile_n\": 64}" \
  --out $OUT/core_power.json > $OUT/core_power.log 2>&1
echo "== bench rc=$?"; grep -v "^\s*$" $OUT/core_power.log | grep -v "warn" | grep "medians\|!!\|failed\|error\|sustained" | tail -40
