# Device call 9 (run 43, one H200: x2 no longer lent): the changed kernel
# code (warpgroup phases, `_OffsetChain`) at final state, GPU tests at D = 1.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_all_gather_kernel.py tests/gpu/test_reduce_scatter_kernel.py tests/gpu/test_kernel_traces.py -k "every_config or schedules_are_exact or traced or float32" > $OUT/tests.log 2>&1
echo "== tests rc=$?"; tail -3 $OUT/tests.log
