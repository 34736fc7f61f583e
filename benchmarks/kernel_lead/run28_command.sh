# Device call 2 (run 28): the reduce-scatter's small-problem cut-off (ours at
# impl=pallas against NCCL + cuBLAS, loopback at 512 and 1024 rows); the
# all-gather's sender count where the tiles leave SMs idle; the 512 wide
# config in loopback (what the link still costs there).
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
run rs_small 200 python .scratch/diag/cutoff.py --rs 128/2048/4096 128/4096/4096 128/5504/4096 \
  256/2048/4096 256/4096/4096 256/5504/4096 384/2048/4096 384/4096/4096 384/5504/4096 \
  512/2048/4096 512/5504/4096 --rs-loopback 512/4096/4096 1024/4096/4096
run ag_senders 170 python .scratch/diag/cutoff.py --ag 128/4096/2048 384/4096/2048 128/4096/5504 64/4096/4096 \
  128/2048/4096 256/8192/4096 128/14336/4096
run ag512_loopback 100 python scripts/bench_kernels.py --rounds 3 --skip-seed --shapes 512/4096/4096:bf16 --rs-shapes \
  --config '{"tile_m": 128, "tile_n": 64, "tile_k": 128, "max_concurrent_steps": 3, "sender_sms": 4, "k_major_sends": true, "loopback": true}' --config '{"tile_m": 128, "tile_n": 64, "tile_k": 64, "max_concurrent_steps": 4, "sender_sms": 4, "k_major_sends": true}' \
  --config '{"tile_m": 128, "tile_n": 64, "tile_k": 64, "max_concurrent_steps": 4, "sender_sms": 4, "k_major_sends": true, "loopback": true}'
python .scratch/diag/summarize.py $OUT/rs_small.json $OUT/ag_senders.json $OUT/ag512_loopback.json
grep -h "!!\|failed\|Error" $OUT/*.log | head -20
