#!/usr/bin/env bash
# One device call: GPU suite, one-process-per-GPU check, full kernel benchmark.
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_check_all.sh OUTDIR
set -u
out=${1:-benchmarks}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > "$out/gpu_info.txt" 2>&1
for r in 0 1; do
  RANK=$r XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 \
    python tests/gpu/multiprocess_check.py > "$out/multiprocess_$r.log" 2>&1 &
done
wait
grep -h "^OK " "$out"/multiprocess_*.log || tail -5 "$out"/multiprocess_*.log
timeout 200 python -m pytest -q tests/gpu -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
tail -3 "$out/gpu_tests.log"
timeout 330 python scripts/bench_kernels.py --windowed --out "$out/raw_kernels.json" \
  > "$out/bench.log" 2>&1
tail -10 "$out/bench.log"
