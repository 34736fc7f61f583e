#!/usr/bin/env bash
# Two processes on one GPU (NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1):
# tests/gpu/multiprocess_check.py (both kernels, jax.distributed, one
# process per rank) with both ranks on GPU 0, each with at most 0.45 of
# its memory. Cases: the image's NCCL (expected to refuse a duplicate GPU),
# then the NCCL whose libnccl.so.2 is given (LD_PRELOAD), an XLA all-gather
# alone and then the kernels. Logs as one archive under OUTDIR.
# Usage (GPU machine, repo root): bash tools/gpu_two_ranks_one_gpu.sh OUTDIR [LIBNCCL]
set -u
out=${1:-/tmp/two_ranks}; nccl=${2:-}; mkdir -p "$out"
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
run_case() {  # name, then env assignments for both ranks
  local name=$1; shift
  local port=$((12800 + RANDOM % 1000))
  for r in 0 1; do
    env RANK=$r CM_MP_PORT=$port CM_MP_DEVICES=visible CUDA_VISIBLE_DEVICES=0 \
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 "$@" timeout 100 \
      python3 tests/gpu/multiprocess_check.py > "$out/$name.$r.log" 2>&1 &
  done
  wait
  echo "== $name: $(grep -h "^OK" "$out/$name".*.log | sort | uniq -c | tr '\n' ';')"
  grep -h -iE "error|failed|duplicate|unhandled|version" "$out/$name".*.log \
    | grep -v "rel_err" | sort | uniq -c | head -6
}
[ -z "${SKIP_IMAGE:-}" ] && run_case image_nccl CM_MP_CONTROL=1 NCCL_DEBUG=WARN
if [ -n "$nccl" ]; then
  python3 -c "import ctypes; v = ctypes.c_int(); ctypes.CDLL('$nccl').ncclGetVersion(ctypes.byref(v)); print('preloaded NCCL', v.value)"
  run_case multi_rank_control CM_MP_CONTROL=1 NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_DEBUG=WARN LD_PRELOAD=$nccl
  # The ops refuse a ring across processes (NCCL 2.28.9 fails it): the
  # kernels called directly.
  run_case multi_rank_kernels CM_MP_DIRECT=1 NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_DEBUG=WARN LD_PRELOAD=$nccl
fi
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
