# Device call 1 (run 21): the k-major senders' announce lag and row parts
# (smaller k groups) at the seed shape and 512 rows; a chainable
# reduce-scatter config at 1024 rows (tile_k 32, 4 stages); GPU tests.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
B='python scripts/bench_kernels.py --rounds 5'
KM='"sender_sms":4,"k_major_sends":true'
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
variants() {  # $1: extra fields (with a trailing comma) for every variant
  for v in '"sender_announce_lag":8' '"sender_announce_lag":4' '"sender_announce_lag":2' \
           '"sender_announce_lag":0' '"sender_row_parts":2,"sender_announce_lag":4' \
           '"sender_row_parts":4,"sender_announce_lag":4' '"sender_row_parts":4,"sender_announce_lag":2' \
           '"sender_row_parts":4,"sender_announce_lag":0'; do
    printf -- '--config\0{%s%s,%s}\0' "$1" "$KM" "$v"
  done
}
mapfile -d '' SEEDV < <(variants "")
mapfile -d '' S512V < <(variants '"tile_n":64,')
run seed 170 $B --rs-shapes --shapes 1024/4096/4096:bf16 "${SEEDV[@]}"
run s512 120 $B --skip-seed --rs-shapes --shapes 512/4096/4096:bf16 "${S512V[@]}"
RS='"tile_k":32,"max_concurrent_steps":4,"epi_tile_m":64,"epi_tile_n":128,"send_pieces":4'
run rs 100 $B --skip-seed --shapes --rs-shapes 1024/4096/4096:bf16 \
  --rs-config "{$RS,\"send_gap\":12}" --rs-config "{$RS,\"send_gap\":12,\"chain_tiles\":true}" \
  --rs-config "{$RS,\"send_gap\":6,\"chain_tiles\":true}"
python .scratch/diag/summarize.py $OUT/seed.json $OUT/s512.json $OUT/rs.json
t0=$SECONDS
timeout 170 python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py \
  -k "every_config or (sender and 2-)" > $OUT/tests.log 2>&1
echo "== tests rc=$? $((SECONDS-t0))s"; tail -3 $OUT/tests.log
