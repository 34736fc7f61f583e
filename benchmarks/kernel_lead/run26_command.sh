# Device call 6 (run 26): issue 13's shapes side by side with the final code,
# 7 rounds, the example included (as runs 17 and 24).
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
run headline 150 python scripts/bench_kernels.py --rounds 7 --shapes 1024/4096/4096:bf16 1024/4096/4096:f16 \
  512/4096/4096:bf16 --rs-shapes 1024/4096/4096:bf16 512/4096/4096:bf16
grep -A12 "^pattern" $OUT/headline.log
