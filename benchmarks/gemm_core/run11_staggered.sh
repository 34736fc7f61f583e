#!/bin/bash
# Run 11 (issue 38): staggered compute warpgroups (`TileConfig.stagger_steps`)
# on one H200: the GPU tests of the staggered configs, then the ten shapes'
# cores against cuBLAS / cuBLASLt fp8, then warpgroup traces at k = 2048.
# Usage (repo root): OUT=DIR bash benchmarks/gemm_core/run11_staggered.sh
export XLA_FLAGS=--xla_gpu_enable_command_buffer= NCCL_NVLS_ENABLE=0 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=plugin:host:tests
E1='"wg_dimension":"m","tile_m":64,"tile_n":256,"epi_tile_m":64,"epi_tile_n":256,"epi_slots":1,"max_concurrent_steps":3,"chain_tiles":true'
S2="$E1,\"stagger_steps\":2"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$OUT/gpu_info.txt" 2>&1
python -c "import jax; print(jax.__version__, jax.devices())" >> "$OUT/gpu_info.txt" 2>&1
date -u >> "$OUT/gpu_info.txt"
timeout 170 python -m pytest -q -x -p no:cacheprovider \
  tests/gpu/test_fp8_kernels_gpu.py tests/gpu/test_core_variants.py \
  -k stagger > "$OUT/tests.log" 2>&1; echo "tests rc=$?" >> "$OUT/tests.log"
tail -3 "$OUT/tests.log"
# The shapes where n is a multiple of 256: 64 x 256 one-slot tiles, with and
# without the stagger; the fp8 and bf16 picks beside them.
timeout 290 python tools/bench_gemm_core.py --rounds 3 --skip-upstream \
  --shapes 16384/4096/2048 16384/2048/4096 16384/4096/6144 16384/5504/4096 \
  2048/4096/4096 16384/4096/7168 16384/7168/4096 16384/4096/3072 \
  16384/4096/14336 \
  --variant "fp8_w256e1={$E1}" --variant "fp8_w256e1s2={$S2}" \
  --variant "rs_fp8_w256e1s2={$S2}" --variant "w256e1s2={$S2}" \
  --variant "rs_w256e1s2={$S2}" \
  --out "$OUT/core_a.json" > "$OUT/core_a.log" 2>&1; echo "rc=$?" >> "$OUT/core_a.log"
tail -16 "$OUT/core_a.log"
# n = 5504 (no multiple of 256): the picked tiles staggered.
timeout 60 python tools/bench_gemm_core.py --rounds 3 --skip-upstream \
  --shapes 16384/4096/5504 \
  --variant 'fp8_s3={"stagger_steps":3}' --variant 'rs_fp8_s2={"stagger_steps":2}' \
  --variant 's3={"stagger_steps":3}' --variant 'rs_s2={"stagger_steps":2}' \
  --out "$OUT/core_b.json" > "$OUT/core_b.log" 2>&1; echo "rc=$?" >> "$OUT/core_b.log"
tail -6 "$OUT/core_b.log"
# Traces: where the time goes per tile, with and without the stagger.
timeout 70 python tools/bench_gemm_core.py --rounds 1 --skip-upstream \
  --shapes 16384/2048/4096 \
  --variant "fp8_w256e1={$E1}" --variant "fp8_w256e1s2={$S2}" \
  --trace-dir "$OUT/traces" \
  --out "$OUT/traces.json" > "$OUT/traces.log" 2>&1; echo "rc=$?" >> "$OUT/traces.log"
tail -4 "$OUT/traces.log"
