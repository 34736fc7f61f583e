"""Loaded before every test folder's conftest: 8 emulated CPU devices.

XLA reads XLA_FLAGS once, when JAX first initialises a backend, so this must
happen before any conftest or test module imports JAX (the GPU suite's
conftest does, to look for Hopper GPUs). On a GPU machine the flag only
affects the CPU host platform.
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS",
                                                                 ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

# The GPU suite runs the Hopper kernels through the drop-in dot_general,
# which uses them only with XLA's command buffers off (see
# collective_matmul.selection.command_buffer_reason).
if "--xla_gpu_enable_command_buffer=" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_gpu_enable_command_buffer="
