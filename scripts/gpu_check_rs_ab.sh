#!/usr/bin/env bash
# One device call: reduce-scatter kernel + new kernel paths (GPU suite part),
# reduce-scatter benchmark, and the end-to-end A/B training run.
# Usage (GPU machine, repo root): bash scripts/gpu_check_rs_ab.sh OUTDIR
set -u
out=${1:-benchmarks}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
timeout 170 python -m pytest -q tests/gpu/test_reduce_scatter_kernel.py \
  -p no:cacheprovider > "$out/gpu_tests_rs.log" 2>&1
rs_ok=$?
tail -4 "$out/gpu_tests_rs.log"
timeout 100 python scripts/bench_kernels.py --shapes --skip-seed \
  --out "$out/raw_reduce_scatter.json" > "$out/bench_rs.log" 2>&1
tail -5 "$out/bench_rs.log"
rs_flag=""
# Keep the A/B meaningful if the reduce-scatter kernel failed its checks.
[ "$rs_ok" -eq 0 ] || rs_flag="--nocollective_matmul_reduce_scatter_kernel"
echo "reduce-scatter kernel tests rc=$rs_ok; A/B extra flags: '$rs_flag'"
timeout 200 python scripts/ab_compare.py model_configs/base.yml \
  model_name=llama3-8b base_num_decoder_layers=2 max_target_length=4096 \
  per_device_batch_size=2 ici_tensor_sequence_parallelism=2 steps=10 \
  fused_mlp=True fused_qkv=True enable_checkpointing=False $rs_flag \
  --output_dir "$out/ab" > "$out/ab.log" 2>&1
grep -v "^  " "$out/ab.log" | grep -v "^I1\|^W1" | tail -8
