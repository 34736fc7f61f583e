# Device call 5 (run 31): issue 13's "every other shape" side by side with
# the current code: ours (impl=auto's config), the example (best of its
# configs), NCCL + cuBLAS, XLA windowed einsum and the bound, 5 rounds.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
run others 450 python scripts/bench_kernels.py --rounds 5 --windowed \
  --shapes 2048/4096/4096:bf16 4096/8192/7168:bf16 2048/8192/14336:bf16 --rs-shapes 4096/7168/8192:bf16
grep -A8 "^pattern" $OUT/others.log
grep -h "!!\|failed\|Error\|timed out" $OUT/others.log | head -10
