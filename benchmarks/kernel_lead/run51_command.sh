# Device call 8 (run 51, one H200): the final code (the wgmma race fix, the
# ping-pong experiment removed): the whole GPU suite at D = 1.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv > $OUT/gpu_info.txt 2>&1
git log --oneline -1 >> $OUT/gpu_info.txt 2>&1
timeout 480 python -m pytest -q -p no:cacheprovider tests/gpu > $OUT/tests.log 2>&1
rc=$?; echo "== tests rc=$rc"; tail -3 $OUT/tests.log
if [ $rc -ne 0 ]; then grep -E "FAILED|Error" $OUT/tests.log | head -20; fi
