# Device call 4: chained tile pipelines (chain_tiles) with eager release and
# k-major senders; the new GPU tests.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
B='python scripts/bench_kernels.py --skip-seed --rounds 5'
KM='"sender_sms":4,"k_major_sends":true'
CH='"chain_tiles":true'
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
run seed 120 $B --rs-shapes --shapes 1024/4096/4096:bf16 --config "{$KM}" --config "{$KM,$CH}" \
  --config "{\"eager_release\":true,$CH}"
run s512 120 $B --rs-shapes --shapes 512/4096/4096:bf16 --config '{"tile_n":64,"eager_release":true}' \
  --config "{\"tile_n\":64,\"eager_release\":true,$CH}" --config "{\"tile_n\":64,\"eager_release\":true,$CH,\"send_gap\":6}" \
  --config "{\"tile_n\":64,\"eager_release\":true,$CH,\"send_gap\":24}" --config "{\"tile_n\":64,$KM,$CH}"
run rs 120 $B --shapes --rs-shapes 512/4096/4096:bf16 \
  --rs-config '{"tile_n":64,"send_gap":6,"send_pieces":4,"chain_tiles":true}'
run s2048 100 $B --rs-shapes --shapes 2048/4096/4096:bf16 --config "{\"eager_release\":true,$CH}" --config "{$KM,$CH}"
python .scratch/diag/summarize.py $OUT/seed.json $OUT/s512.json $OUT/rs.json $OUT/s2048.json
t0=$SECONDS
timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py -k every_config > $OUT/tests_ag.log 2>&1
echo "== tests_ag rc=$? $((SECONDS-t0))s"; tail -2 $OUT/tests_ag.log
t0=$SECONDS
timeout 120 python -m pytest -q -p no:cacheprovider tests/gpu/test_reduce_scatter_kernel.py -k "schedules" > $OUT/tests_rs.log 2>&1
echo "== tests_rs rc=$? $((SECONDS-t0))s"; tail -2 $OUT/tests_rs.log
