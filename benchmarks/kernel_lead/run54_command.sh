# Device call 11 (run 54, one H200): multicast clusters at the power cap, upstream kernel, two warpgroup tilings.
export PYTHONPATH=plugin:host:scripts NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 XLA_FLAGS="--xla_gpu_enable_command_buffer="
timeout 300 python benchmarks/kernel_lead/run54_upstream_clusters.py 2>&1 | grep -v Warn | tee $OUT/run54.log | tail -30
