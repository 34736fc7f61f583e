# Device call 2 (run 22), diagnostic: what a k-major tile's wait for a k
# group costs. CM_DIAG_WAIT (a local, uncommitted switch in wait_k_group):
# unset = the sys-scope wait; gpu = gpu-scope load and fence; none = no
# wait (WRONG RESULTS: the tiles do not wait for their data).
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
B='python scripts/bench_kernels.py --rounds 3 --skip-seed --rs-shapes'
KM='"sender_sms":4,"k_major_sends":true,"sender_announce_lag":0'
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
C=(--config "{$KM}" --config "{$KM,\"loopback\":true}" --config "{$KM,\"sender_row_parts\":2}"
   --config "{$KM,\"sender_row_parts\":4}" --config "{$KM,\"sender_row_parts\":4,\"loopback\":true}")
C512=(--config "{\"tile_n\":64,$KM}" --config "{\"tile_n\":64,$KM,\"sender_row_parts\":4}")
run sys 100 $B --shapes 1024/4096/4096:bf16 "${C[@]}"
CM_DIAG_WAIT=gpu run gpu 100 $B --shapes 1024/4096/4096:bf16 "${C[@]}"
CM_DIAG_WAIT=none run none 100 $B --shapes 1024/4096/4096:bf16 "${C[@]}"
run sys512 80 $B --shapes 512/4096/4096:bf16 "${C512[@]}"
CM_DIAG_WAIT=gpu run gpu512 80 $B --shapes 512/4096/4096:bf16 "${C512[@]}"
python .scratch/diag/summarize.py $OUT/sys.json $OUT/gpu.json $OUT/none.json $OUT/sys512.json $OUT/gpu512.json
