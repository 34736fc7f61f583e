# Device call 1 (run 27): the small-problem cut-off. All-gather shapes below
# and around today's cut-off, ours (impl=pallas at the current selection)
# and dedicated-sender variants against NCCL + cuBLAS, 3 rounds.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
run ag_small 330 python .scratch/diag/cutoff.py --ag 128/4096/2048 128/4096/4096 128/4096/5504 128/4096/8192 \
  256/4096/2048 256/4096/4096 256/4096/5504 256/4096/8192
run ag_mid 170 python .scratch/diag/cutoff.py --ag 384/4096/2048 384/4096/4096 512/4096/2048
python .scratch/diag/summarize.py $OUT/ag_small.json $OUT/ag_mid.json
grep -h "!!\|failed\|Error" $OUT/*.log | head -20
