#!/usr/bin/env bash
# The A/B inside real MaxText on the lent GPU machine, in one device call:
# installs the carried wheels (.whl/, see scripts/maxtext_wheels.txt) into a
# fresh private directory (mktemp -d, removed on exit), then runs scripts/maxtext_ab.py with the arms off, auto and
# XLA's windowed einsum on a llama2-7b-shaped model (2 layers, sequence
# 4096, tensor-sequence parallelism over every GPU). Results in OUTDIR
# (ab.json, report.md, ab.png, logs.tgz: at most 8 files come back).
#
# Usage (device machine, repo root, .whl carried):
#   bash scripts/gpu_maxtext_ab.sh OUTDIR [extra MaxText key=value ...]
set -u
out=${1:?usage: gpu_maxtext_ab.sh OUTDIR [key=value ...]}; shift
mkdir -p "$out"
# The carried wheels go first on PYTHONPATH, so their directory is this run's
# own: a fixed path under the shared temp folder could be another user's.
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu_maxtext_ab.XXXXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
site=$tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target "$site" .whl/*.whl || exit 1
export PYTHONPATH=$site:$PWD/plugin:$PWD/host
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > "$out/gpu_info.txt" 2>&1
# PROFILE_STEPS=N: profile N steps per arm (the breakdown in report.md).
# ROUNDS=R: run every arm R times, order reversed every other round, step
# times pooled (scripts/maxtext_ab.py --rounds).
# MODEL: MaxText's model_name (default llama2-7b). COMPARE: ARM=BASELINE
# pairs, comma-separated (scripts/maxtext_ab.py --compare).
# Extra arms, one per line in $EXTRA_ARMS_SPEC: NAME=ARGS (scripts/maxtext_ab.py).
EXTRA_ARMS=()
for pair in ${COMPARE:+${COMPARE//,/ }}; do EXTRA_ARMS+=(--compare "$pair"); done
while IFS= read -r arm; do
  [ -n "$arm" ] && EXTRA_ARMS+=(--arm "$arm")
done <<< "${EXTRA_ARMS_SPEC:-}"
work=$tmp/maxtext_ab
timeout "${AB_TIMEOUT:-560}" python3 scripts/maxtext_ab.py --out "$work" \
  --arms "${ARMS:-off,auto,windowed}" --timeout "${ARM_TIMEOUT:-170}" "${EXTRA_ARMS[@]}" \
  --profile_steps "${PROFILE_STEPS:-0}" --rounds "${ROUNDS:-1}" \
  --title "${MODEL:-llama2-7b} dims, 2 layers, seq 4096, tensor_sequence=$ngpu, ${ngpu} x H200" \
  -- "$site/maxtext/configs/base.yml" hardware=gpu \
  skip_jax_distributed_system=True dataset_type=synthetic \
  model_name="${MODEL:-llama2-7b}" override_model_config=True base_num_decoder_layers=2 \
  max_target_length=4096 per_device_batch_size=2 \
  ici_tensor_sequence_parallelism="$ngpu" ici_data_parallelism=1 \
  ici_fsdp_parallelism=1 steps="${STEPS:-15}" enable_checkpointing=False \
  jax_cache_dir=/tmp/jax_cache "$@"
rc=$?
cp "$work"/ab.json "$work"/report.md "$work"/ab.png "$out"/ 2>/dev/null
tar czf "$out/logs.tgz" -C "$work" --exclude runs . 2>/dev/null
echo "maxtext_ab rc=$rc"
exit $rc
