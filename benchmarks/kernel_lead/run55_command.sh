# Device call 1 of the eleventh session (run 55, one H200; 290 s of device
# time were left, x2/x4/x8 not lent): `--trace-warmups` above 1 on a GPU
# (never run before), and the traced-kernel GPU tests at D = 1, on the
# final kernel code (de65204). Predicted: the kept trace is the 3rd call's,
# its per-tile k loop within 2 % of run 36's, the tests pass.
set -u
OUT=${OUT:?}
export PYTHONPATH=plugin:host NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv > $OUT/gpu_info.txt 2>&1
python -c "import jax; print('jax', jax.__version__)" >> $OUT/gpu_info.txt 2>&1
timeout 80 python scripts/bench_gemm_core.py --skip-upstream --iterations 20 \
  --shapes 8192/4096/4096 --trace-dir $OUT/traces --trace-warmups 3 \
  --out $OUT/core_trace_warmups.json > $OUT/core_trace_warmups.log 2>&1
echo "== bench rc=$?"; grep "|" $OUT/core_trace_warmups.log | tail -6
ls -la $OUT/traces 2>&1 | head
timeout 60 python -m pytest -q -p no:cacheprovider tests/gpu/test_kernel_traces.py > $OUT/tests.log 2>&1
echo "== tests rc=$?"; tail -3 $OUT/tests.log
