# Device call 6: chained tiles at the multi-wave llama2 shapes; GPU suites.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
B='python scripts/bench_kernels.py --skip-seed --rounds 3 --rs-shapes'
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
run n11008 80 $B --shapes 8192/4096/11008:bf16 --config '{"send_gap":16,"eager_release":true}' \
  --config '{"send_gap":16,"eager_release":true,"chain_tiles":true}'
run n6144 80 $B --shapes 8192/4096/6144:bf16 --config '{"sender_sms":4,"chain_tiles":true}'
run n2048 80 $B --shapes 8192/4096/2048:bf16 --config '{"eager_release":true,"chain_tiles":true}'
python .scratch/diag/summarize.py $OUT/n11008.json $OUT/n6144.json $OUT/n2048.json
t0=$SECONDS
timeout 170 python -m pytest -q -p no:cacheprovider tests/gpu/test_reduce_scatter_kernel.py > $OUT/tests_rs.log 2>&1
echo "== tests_rs rc=$? $((SECONDS-t0))s"; tail -2 $OUT/tests_rs.log
t0=$SECONDS
timeout $((480 - SECONDS)) python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py \
  -k "not every_config" > $OUT/tests_ag.log 2>&1
echo "== tests_ag rc=$? $((SECONDS-t0))s"; tail -2 $OUT/tests_ag.log
