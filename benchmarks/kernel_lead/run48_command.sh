# Device call 4 (run 48, one H200): which part of a 64 x 256 warpgroup tile is wrong.
export PYTHONPATH=plugin:host XLA_FLAGS="--xla_gpu_enable_command_buffer=" NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
timeout 300 python benchmarks/kernel_lead/run48_probe_w256.py 2>&1 | grep -v Warn | tee $OUT/probe.log
