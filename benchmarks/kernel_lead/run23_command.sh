# Device call 3 (run 23), diagnostic: is a sender block bound by its loads
# in flight? CM_DIAG_AHEAD (a local, uncommitted switch in
# schedule.sender_pipeline): loads ahead out of the 12 slots (default 4;
# the rest are stores in flight). K-major senders, announce lag 0 and the
# default; seed shape and 512 rows; the example in the first invocation.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
B='python scripts/bench_kernels.py --rounds 3 --skip-seed --rs-shapes'
KM='"sender_sms":4,"k_major_sends":true'
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
C=(--config "{$KM,\"sender_announce_lag\":0}" --config "{$KM,\"sender_announce_lag\":0,\"loopback\":true}"
   --config "{\"tile_n\":64,$KM}" --config "{\"tile_n\":64,$KM,\"sender_announce_lag\":0}")
for a in 4 6 8 10; do
  CM_DIAG_AHEAD=$a run ahead$a 115 $B --shapes 1024/4096/4096:bf16 512/4096/4096:bf16 "${C[@]}"
done
python .scratch/diag/summarize.py $OUT/ahead4.json $OUT/ahead6.json $OUT/ahead8.json $OUT/ahead10.json
