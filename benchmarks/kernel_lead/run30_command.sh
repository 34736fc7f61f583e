# Device call 4 (run 30): wider sender chunks (sender_chunk_blocks = 2: a
# sender copies 2 adjacent k blocks, 256-byte rows, the tiles' k step kept
# at 64). Balanced (by rows) senders at several waves per step, where they
# lost below n = 4096 (run 7), and k-major at the seed shape. Then the GPU
# tests of the new field (and every config).
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
B='"sender_sms":4,"chain_tiles":true'
for n in 3072 2048; do
  run n$n 100 python scripts/bench_kernels.py --rounds 3 --skip-seed --rs-shapes --shapes 8192/4096/$n:bf16 \
    --config "{$B}" --config "{$B,\"sender_chunk_blocks\":2}"
done
K='"sender_sms":4,"k_major_sends":true'
run seed 70 python scripts/bench_kernels.py --rounds 5 --skip-seed --rs-shapes --shapes 1024/4096/4096:bf16 \
  --config "{$K,\"sender_chunk_blocks\":2}"
run n4096 100 python scripts/bench_kernels.py --rounds 3 --skip-seed --rs-shapes --shapes 8192/4096/4096:bf16 \
  --config "{$B,\"sender_chunk_blocks\":2}"
python .scratch/diag/summarize.py $OUT/n3072.json $OUT/n2048.json $OUT/seed.json $OUT/n4096.json
grep -h "!!\|failed\|Error" $OUT/n*.log $OUT/seed.log | head -20
t0=$SECONDS
timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py -k "chunk" > $OUT/tests.log 2>&1
echo "== tests rc=$? $((SECONDS-t0))s"; tail -3 $OUT/tests.log
