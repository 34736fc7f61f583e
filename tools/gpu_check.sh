#!/usr/bin/env bash
# GPU checks for one device call, as named steps; each step has its own
# timeout (a hung ring costs that step, not the call), its log under OUTDIR
# and a one-line summary on stdout.
#
# Usage (GPU machine, repo root):
#   bash tools/gpu_check.sh OUTDIR STEP [STEP ...]
# Steps:
#   tests_rs     tests/gpu/test_reduce_scatter_kernel.py
#   tests_ag     tests/gpu/test_all_gather_kernel.py (one process; the
#                one-process-per-GPU test is xfail, see BUILD.md)
#   multiprocess tests/gpu/multiprocess_check.py as one process per GPU
#   bench_rs     bench_kernels.py, reduce-scatter shapes ($BENCH_ARGS appended)
#   bench_ag     bench_kernels.py, all-gather shapes ($BENCH_ARGS appended)
#   bench        bench_kernels.py with $BENCH_ARGS only (default: every shape)
#   ab           the reference host's A/B training step (llama3-8b, 2 layers)
#   tests_d1     all of tests/gpu but the rings' harness (one GPU is enough)
#   rings        tools/rings_one_gpu.py: the rings as virtual ranks on GPU 0,
#                JSON in OUTDIR/rings.json ($RINGS_ARGS appended, e.g.
#                "--only picked" or "--start N"; it stops starting cases a
#                minute before its timeout)
#   core         tools/bench_gemm_core.py, one process per shape (its ten, or
#                $CORE_SHAPES), --rounds 2 ($CORE_ARGS appended), JSON per
#                shape in OUTDIR/core/, plot OUTDIR/core.png
#   rowwise      rowwise fp8 (row and column scales): its three parts in
#                turn, each also a step of its own:
#   rowwise_tests  tests/gpu's rowwise files (D = 1 cores, the ops' dispatch)
#   rowwise_rings  the rings as virtual ranks (rings_one_gpu.py --only
#                /rowwise/, JSON in OUTDIR/rowwise_rings.json)
#   rowwise_core the fp8 cores per shape as `core` does, per-tensor and
#                rowwise, ours and XLA's (--rowwise, the eight fp8 arms;
#                OUTDIR/rowwise_core/)
# Step timeouts can be set as TIMEOUT_<step>=seconds (core, rowwise_core:
# per shape; rowwise_tests, rowwise_rings: the rowwise step's parts).
set -u
out=${1:?usage: gpu_check.sh OUTDIR STEP...}; shift
mkdir -p "$out"
export PYTHONPATH=plugin:host:tests NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# XLA command buffers off, as the suite ran before: the checks under them
# are tools/command_buffer_check.py's (tools/gpu_installed_setup.sh).
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv \
  > "$out/gpu_info.txt" 2>&1
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
read -r -a bench_args <<< "${BENCH_ARGS:-}"
read -r -a rings_args <<< "${RINGS_ARGS:-}"
read -r -a core_args <<< "${CORE_ARGS:-}"

step_timeout() { local v="TIMEOUT_$1"; echo "${!v:-$2}"; }

run_step() {  # name, default timeout, command...
  local name=$1 limit; limit=$(step_timeout "$1" "$2"); shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s (limit ${limit}s)"
  return $rc
}

core_per_shape() {  # folder, bench_gemm_core.py arguments...
  local folder=$1; shift
  mkdir -p "$out/$folder"
  local shapes shape name
  read -r -a shapes <<< "${CORE_SHAPES:-$(python -c \
    'import sys; sys.path.insert(0, "tools"); import bench_gemm_core; print(*bench_gemm_core.TEN_SHAPES)')}"
  for shape in "${shapes[@]}"; do
    name=${folder}_${shape//\//_}
    run_step "$name" "$(step_timeout "$folder" 90)" \
      python tools/bench_gemm_core.py --rounds 2 --skip-upstream \
      --shapes "$shape" --out "$out/$folder/$name.json" "$@"
    grep -h "medians" "$out/$name.log" || true  # None with --plan.
  done
}

for step in "$@"; do
  case $step in
    tests_rs)
      run_step tests_rs 240 python -m pytest -q -p no:cacheprovider \
        tests/gpu/test_reduce_scatter_kernel.py
      tail -3 "$out/tests_rs.log";;
    tests_ag)
      run_step tests_ag 240 python -m pytest -q -p no:cacheprovider \
        tests/gpu/test_all_gather_kernel.py
      tail -3 "$out/tests_ag.log";;
    multiprocess)
      for r in $(seq 0 $((ngpu - 1))); do
        RANK=$r XLA_PYTHON_CLIENT_PREALLOCATE=false \
          run_step "multiprocess_$r" 120 python tests/gpu/multiprocess_check.py &
      done
      wait
      grep -h "^OK " "$out"/multiprocess_*.log || tail -3 "$out"/multiprocess_*.log;;
    bench_rs)
      run_step bench_rs 300 python tools/bench_kernels.py --shapes \
        --out "$out/raw_reduce_scatter.json" "${bench_args[@]}"
      tail -5 "$out/bench_rs.log";;
    bench_ag)
      run_step bench_ag 330 python tools/bench_kernels.py --rs-shapes \
        --out "$out/raw_kernels.json" "${bench_args[@]}"
      tail -9 "$out/bench_ag.log";;
    bench)
      run_step bench 500 python tools/bench_kernels.py \
        --out "$out/raw_bench.json" "${bench_args[@]}"
      grep -A12 "^pattern" "$out/bench.log";;
    ab)
      run_step ab 300 python scripts/ab_compare.py model_configs/base.yml \
        model_name=llama3-8b base_num_decoder_layers=2 max_target_length=4096 \
        per_device_batch_size=2 ici_tensor_sequence_parallelism="$ngpu" \
        steps=10 fused_mlp=True fused_qkv=True enable_checkpointing=False \
        --output_dir "$out/ab"
      grep -v "^  " "$out/ab.log" | grep -v "^I1\|^W1" | tail -8;;
    tests_d1)
      run_step tests_d1 480 python -m pytest -q -p no:cacheprovider tests/gpu \
        --ignore=tests/gpu/test_rings_one_gpu.py
      tail -1 "$out/tests_d1.log";;
    rings)
      limit=$(step_timeout rings 540)
      run_step rings "$limit" python tools/rings_one_gpu.py --hang-s 20 \
        --budget-s $((limit > 120 ? limit - 60 : limit / 2)) \
        --out "$out/rings.json" "${rings_args[@]}"
      tail -3 "$out/rings.log";;
    core)
      core_per_shape core "${core_args[@]}"
      if compgen -G "$out/core/*.json" > /dev/null; then  # Not with --plan.
        python tools/plot_gemm_core.py "$out"/core/*.json "$out/core.png"
      fi;;
    rowwise|rowwise_tests)
      run_step rowwise_tests 300 python -m pytest -q -p no:cacheprovider \
        tests/gpu/test_rowwise_kernels_gpu.py \
        tests/gpu/test_rowwise_dispatch_gpu.py
      tail -1 "$out/rowwise_tests.log";;&
    rowwise|rowwise_rings)
      limit=$(step_timeout rowwise_rings 300)
      run_step rowwise_rings "$limit" python tools/rings_one_gpu.py \
        --hang-s 20 --budget-s $((limit > 120 ? limit - 60 : limit / 2)) \
        --only /rowwise/ --out "$out/rowwise_rings.json" "${rings_args[@]}"
      tail -3 "$out/rowwise_rings.log";;&
    rowwise|rowwise_core)
      core_per_shape rowwise_core --rowwise --only cublas_fp8 cublas_fp8_rs \
        ours_fp8 ours_fp8_rs cublas_fp8_rowwise cublas_fp8_rs_rowwise \
        ours_fp8_rowwise ours_fp8_rs_rowwise "${core_args[@]}";;
    rowwise_tests|rowwise_rings|rowwise_core) ;;  # Ran above.
    *)
      echo "unknown step '$step' (see the header of $0)"; exit 2;;
  esac
done
