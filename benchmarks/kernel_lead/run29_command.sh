# Device call 3 (run 29): GPU tests of the small-problem selection (exact,
# poisoned, repeatable; auto forward and backward at 256 rows) with the rest
# of the all-gather configs and the reduce-scatter file; then the box's
# edges: tiny k or n, k = 14336, against NCCL + cuBLAS.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/gpu_info.txt 2>&1
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0))s"; }
t0=$SECONDS
timeout 280 python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py tests/gpu/test_reduce_scatter_kernel.py \
  -k "small_problem or auto_overlaps or every_config or wide_sender or schedules or gradients" > $OUT/tests.log 2>&1
echo "== tests rc=$? $((SECONDS-t0))s"; tail -3 $OUT/tests.log
run edges 200 python .scratch/diag/cutoff.py --ag 256/1024/1024 128/1024/4096 256/4096/1024 256/14336/4096 512/2048/2048 \
  --rs 256/1024/1024 128/4096/1024 256/14336/4096 128/8192/4096
python .scratch/diag/summarize.py $OUT/edges.json
grep -h "!!\|failed\|Error" $OUT/edges.log | head -20
