# Device call 5: issue 13's shapes side by side under the new selection
# (7 rounds, the example included); eager release / chained tiles at a
# large shape; the GPU test of the selection at the seed shape.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
run headline 300 python scripts/bench_kernels.py --rounds 7 --shapes 1024/4096/4096:bf16 1024/4096/4096:f16 \
  512/4096/4096:bf16 --rs-shapes 1024/4096/4096:bf16 512/4096/4096:bf16
grep -A12 "^pattern" $OUT/headline.log
run large 100 python scripts/bench_kernels.py --skip-seed --rounds 3 --rs-shapes --shapes 8192/4096/2048:bf16 \
  --config '{"eager_release":true}' --config '{"eager_release":true,"chain_tiles":true}'
python .scratch/diag/summarize.py $OUT/headline.json $OUT/large.json
t0=$SECONDS
timeout $((545 - SECONDS)) python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py \
  -k "matches_f32 and 1024-4096-4096" > $OUT/tests_seed.log 2>&1
echo "== tests_seed rc=$? $((SECONDS-t0))s"; tail -2 $OUT/tests_seed.log
