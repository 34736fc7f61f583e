#!/usr/bin/env bash
# One process per GPU: which setup works? Runs tests/gpu/multiprocess_check.py
# as 2 processes under several setups, 90 s each, logs under OUTDIR.
# Usage (GPU machine, repo root): bash tools/gpu_multiprocess_diag.sh OUTDIR
set -u
out=${1:-/tmp/mp}; mkdir -p "$out"
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{
  python -c "import jax, jaxlib; print('jax', jax.__version__)"
  pip list 2>/dev/null | grep -i -E "nvshmem|nccl|jax"
  python - <<'PY'
import inspect, jax.experimental.mosaic.gpu.core as c
src = inspect.getsource(c)
i = src.find("def is_nvshmem_available")
print(src[i:i + 900])
PY
  for so in $(python -c "import jaxlib, jax_plugins, os; print(' '.join(p for p in jaxlib.__path__ + list(jax_plugins.__path__)))"); do
    find "$so" -name "*.so*" | while read -r f; do
      grep -aoE "xla_gpu_[a-z_]*(nvshmem|collective_metadata|symmetric|user_buffer|cumem|collective_memory|nccl_)[a-z_]*" "$f" | sort -u | sed "s|^|$(basename "$f"): |"
    done
  done | sort -u | head -40
} > "$out/env.txt" 2>&1
head -c 3000 "$out/env.txt"

run_case() {  # name, then env assignments for both ranks
  local name=$1; shift
  local port=$((12800 + RANDOM % 1000))
  for r in 0 1; do
    local vis=()
    [[ " $* " == *" CM_MP_DEVICES=visible "* ]] && vis=(CUDA_VISIBLE_DEVICES=$r)
    env RANK=$r CM_MP_PORT=$port "${vis[@]}" "$@" timeout 90 \
      python tests/gpu/multiprocess_check.py > "$out/$name.$r.log" 2>&1 &
  done
  wait
  echo "== $name: $(grep -h "^OK" "$out/$name".*.log | sort | uniq -c | tr '\n' ';')"
  grep -h -iE "error|failed|unhandled" "$out/$name".*.log | grep -v "^I0\|rel_err" | sort | uniq -c | head -5
}
cases=${CASES:-"control local_ids nvshmem"}
for c in $cases; do
  case $c in
    control) run_case control CM_MP_CONTROL=1 NCCL_DEBUG=WARN ;;
    local_ids) run_case local_ids NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ALL ;;
    visible) run_case visible CM_MP_DEVICES=visible NCCL_DEBUG=INFO ;;
    nvshmem) run_case nvshmem CM_MP_NVSHMEM=1 NCCL_DEBUG=WARN NVSHMEM_DEBUG=INFO ;;
    symmetric) run_case symmetric NCCL_DEBUG=WARN XLA_FLAGS=--xla_gpu_experimental_enable_nccl_symmetric_buffers=true ;;
    user_buffers) run_case user_buffers NCCL_DEBUG=WARN XLA_FLAGS=--xla_gpu_enable_nccl_user_buffers=true ;;
    persistent) run_case persistent NCCL_DEBUG=WARN XLA_FLAGS=--xla_gpu_enable_persistent_symmetric_memory=true ;;
    platform_alloc) run_case platform_alloc NCCL_DEBUG=WARN XLA_PYTHON_CLIENT_ALLOCATOR=platform ;;
    nvshmem_visible) run_case nvshmem_visible CM_MP_NVSHMEM=1 CM_MP_DEVICES=visible NVSHMEM_DEBUG=INFO ;;
    *) echo "unknown case '$c' (known: control local_ids visible nvshmem symmetric user_buffers persistent platform_alloc nvshmem_visible)" >&2 ;;
  esac
done
# The device tool returns a limited number of files: one archive.
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out"
