#!/usr/bin/env bash
# One device call: reduce-scatter benchmark, all-gather GPU suite, all-gather
# benchmark (no windowed einsum). Usage (GPU machine, repo root):
#   bash scripts/gpu_final_check.sh OUTDIR
set -u
out=${1:-benchmarks}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > "$out/gpu_info.txt" 2>&1
timeout 120 python scripts/bench_kernels.py --shapes \
  --rs-config '{"epi_tile_n":64,"max_concurrent_steps":4}' \
  --out "$out/raw_reduce_scatter.json" > "$out/bench_rs.log" 2>&1
tail -4 "$out/bench_rs.log"
timeout 170 python -m pytest -q tests/gpu/test_all_gather_kernel.py -p no:cacheprovider \
  -k "not one_process_per_gpu" > "$out/gpu_tests_ag.log" 2>&1
tail -2 "$out/gpu_tests_ag.log"
timeout 260 python scripts/bench_kernels.py --rs-shapes \
  --out "$out/raw_kernels.json" > "$out/bench_ag.log" 2>&1
tail -9 "$out/bench_ag.log"
