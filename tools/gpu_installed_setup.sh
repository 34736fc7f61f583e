#!/usr/bin/env bash
# What README's install gives a user (JAX 0.12.0.1, NCCL 2.32) beside the
# GPU image's JAX 0.11.2 / NCCL 2.28.9, checked on one GPU.
#
# Here (the project root), once per session: fetch the wheels and split them
# into device calls (the transfer takes 64 MiB a call), JAX's four wheels
# as .carryj1-4 and NCCL's as .carryn1-4:
#   bash tools/gpu_installed_setup.sh parts
# It prints the calls to make back to back (each within 30 s of the last
# reply); the last of a set joins its parts into $HOME/carry_site there
# (`bash .carryj4/join.sh $HOME/carry_site`; JAX's set first: its checks
# need no NCCL 2.32). Then, on the GPU machine (repo root), while warm:
#   bash tools/gpu_installed_setup.sh STEP OUTDIR [STEP ...]
# OUTDIR ends as OUTDIR.tgz (logs, JSON; XLA dumps left out, their
# summaries in the logs, one thunk sequence with a kernel inside a command
# buffer kept per dump as thunks_*.txt).
# Steps (each under its own timeout, its log in OUTDIR):
#   facts         both JAX's versions, devices, the NCCL each loads
#   cb_012 cb_011 tools/command_buffer_check.py under XLA's default flags
#                 (command buffers on), XLA dump kept as proof of capture,
#                 on JAX 0.12 / the image's JAX 0.11.2 ($CB_ARGS appended)
#   cb_off_012    the same with command buffers off (the control)
#   cb_small_012 cb_small_011  the same with --xla_gpu_graph_min_graph_size=1
#   mp_012 mp_011 two processes on GPU 0 (NCCL_MULTI_RANK_GPU_ENABLE=1) with
#                 NCCL 2.32 (0.11.2: preloaded): tests/gpu/multiprocess_check.py
#                 CM_MP_AUTO=1 under default flags
#   mp_image      the image's JAX 0.11.2 and NCCL 2.28.9 under `auto`: the
#                 ring must be refused (baseline), not hang
#   step_cb_012 step_cb_011  the reference host's llama3-8b (2 layers, 2 x 4096 tokens)
#                 training step, plugin on, command buffers on / off / on
#                 ($STEPS steps each, default 30)
#   tests_d1_012  tests/gpu at D = 1 (but the rings' harness) on JAX 0.12
#   core_012 core_011  bench_gemm_core.py at $CORE_SHAPES (default: its ten)
#   rings_012     tools/rings_one_gpu.py on JAX 0.12 ($RINGS_ARGS)
set -u
if [ "${1:-}" = parts ]; then
  mkdir -p /tmp/wheels
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_27_x86_64 -d /tmp/wheels \
    jax==0.12.0.1 jaxlib==0.12.0.1 jax-cuda13-plugin==0.12.0.1 \
    jax-cuda13-pjrt==0.12.0.1 nvidia-nccl-cu13==2.32.6
  grep -q '^/.carry\*/$' .git/info/exclude 2>/dev/null || echo '/.carry*/' >> .git/info/exclude
  python3 ../shared/tools/split_carry.py --prefix .carryj /tmp/wheels/jax*.whl
  exec python3 ../shared/tools/split_carry.py --prefix .carryn /tmp/wheels/nvidia_nccl*.whl
fi
step_list=(); out=""
for arg in "$@"; do
  if [ -z "$out" ] && [[ "$arg" == */* || "$arg" == /* ]]; then out=$arg; else step_list+=("$arg"); fi
done
out=${out:-/tmp/installed_setup}; mkdir -p "$out"
site=$HOME/carry_site
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
base_path=plugin:host:tests:tools
nccl012=$site/nvidia/nccl/lib/libnccl.so.2
# Runners (files, so that timeout can run them): JAX 0.12 from the carried
# site, or the image's JAX 0.11.2.
printf '#!/bin/sh\nexec env PYTHONPATH=%s "$@"\n' "$site:$base_path" > /tmp/j012
printf '#!/bin/sh\nexec env PYTHONPATH=%s "$@"\n' "$base_path" > /tmp/j011
chmod +x /tmp/j012 /tmp/j011
j012() { /tmp/j012 "$@"; }
j011() { /tmp/j011 "$@"; }
run_step() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"
  return $rc
}
two_ranks() {  # name, jax runner (j012|j011), env assignments...
  local name=$1 runner=$2; shift 2
  local port=$((12800 + RANDOM % 1000)) t0=$SECONDS
  for r in 0 1; do
    $runner env RANK=$r CM_MP_PORT=$port CM_MP_DEVICES=visible CUDA_VISIBLE_DEVICES=0 \
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 CM_MP_AUTO=1 \
      XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$out/dumps/$name.$r --xla_dump_hlo_as_text" "$@" \
      timeout 240 python3 tests/gpu/multiprocess_check.py > "$out/$name.$r.log" 2>&1 &
  done
  wait
  echo "== $name $((SECONDS - t0))s: $(grep -h "^OK\|^WRONG" "$out/$name".*.log | sort | uniq -c | tr '\n' ';')"
  grep -h "^DECIDE" "$out/$name".0.log | cut -c1-400
  grep -h -iE "error|unhandled|Traceback" "$out/$name".*.log | sort | uniq -c | head -4
  for r in 0 1; do
    j011 python3 -c "import sys, xla_capture; print('capture rank $r', xla_capture.dump_summary(sys.argv[1]))" \
      "$out/dumps/$name.$r" | cut -c1-600
  done
}
step_run() {  # name, runner, XLA_FLAGS, model args... (plugin on)
  local name=$1 runner=$2 flags=$3; shift 3
  $runner env XLA_FLAGS="$flags" timeout 300 python3 scripts/train.py \
    model_configs/base.yml model_name=llama3-8b base_num_decoder_layers=2 \
    max_target_length=4096 per_device_batch_size=2 steps="${STEPS:-30}" \
    enable_checkpointing=False --use_collective_matmul \
    base_output_directory="$out" run_name="$name" > "$out/$name.log" 2>&1
  echo "== $name: $(grep -h "median step time" "$out/$name.log" | tail -1)"
}
for step in "${step_list[@]}"; do
  case $step in
    facts)
      nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu_info.txt" 2>&1
      for runner in j011 j012; do
        $runner python3 -c "
import jax, collective_matmul.selection as s
d = jax.devices()
print('$runner', 'jax', jax.__version__, d[0].device_kind, 'nccl loaded', s.loaded_nccl_version(), 'command buffers', sorted(s.command_buffer_types()), 'reason', s.command_buffer_reason('gpu'))
" 2>&1 | grep -v "^W\|^I" | tail -2
      done;;
    cb_012|cb_011|cb_off_012|cb_small_012|cb_small_011)
      runner=/tmp/j${step##*_}; flags=""
      [ "$step" = cb_off_012 ] && flags="--xla_gpu_enable_command_buffer="
      # Every run of capturable thunks a graph, however short.
      [[ "$step" = cb_small_* ]] && flags="--xla_gpu_graph_min_graph_size=1"
      XLA_FLAGS="$flags" run_step "$step" 240 $runner python3 tools/command_buffer_check.py \
        --out "$out/$step.json" --dump "$out/dumps/$step" ${CB_ARGS:-}
      grep -E "^(virtual|ops|fp8|mutation|capture|SUMMARY)" "$out/$step.log" | cut -c1-200;;
    mp_012) two_ranks mp_012 j012 NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_DEBUG=WARN;;
    mp_011) two_ranks mp_011 j011 NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_DEBUG=WARN LD_PRELOAD=$nccl012;;
    mp_image) two_ranks mp_image j011 NCCL_DEBUG=WARN;;
    step_cb_012|step_cb_011)
      runner=/tmp/j${step##*_}
      step_run "${step}_on_1" $runner ""
      step_run "${step}_off" $runner "--xla_gpu_enable_command_buffer="
      step_run "${step}_on_2" $runner "";;
    tests_d1_012)
      run_step tests_d1_012 480 /tmp/j012 python3 -m pytest -q -p no:cacheprovider tests/gpu \
        --ignore=tests/gpu/test_rings_one_gpu.py
      tail -1 "$out/tests_d1_012.log";;
    core_012|core_011)
      runner=/tmp/j${step##*_}; mkdir -p "$out/$step"
      read -r -a shapes <<< "${CORE_SHAPES:-$(python3 -c \
        'import sys; sys.path.insert(0, "tools"); import bench_gemm_core; print(*bench_gemm_core.TEN_SHAPES)')}"
      for shape in "${shapes[@]}"; do
        name=${step}_${shape//\//_}
        run_step "$name" 120 $runner python3 tools/bench_gemm_core.py --rounds 2 \
          --skip-upstream --shapes "$shape" --out "$out/$step/$name.json" ${CORE_ARGS:-}
        grep -h "medians" "$out/$name.log"
      done;;
    rings_012)
      run_step rings_012 "${TIMEOUT_rings:-540}" /tmp/j012 python3 tools/rings_one_gpu.py --hang-s 20 \
        --budget-s $(( ${TIMEOUT_rings:-540} - 60 )) --out "$out/rings_012.json" ${RINGS_ARGS:-}
      tail -3 "$out/rings_012.log";;
    *) echo "unknown step '$step' (see the header of $0)"; exit 2;;
  esac
done
# One optimized module with a kernel inside a command buffer, as kept proof.
for d in "$out"/dumps/*; do
  [ -d "$d" ] || continue
  f=$(grep -l "kCommandBuffer" "$d"/*thunk_sequence_after_thunk_passes.txt 2>/dev/null | head -1)
  [ -n "$f" ] && cp "$f" "$out/thunks_$(basename "$d").txt"
done
tar czf "$out.tgz" -C "$(dirname "$out")" --exclude=dumps "$(basename "$out")"
