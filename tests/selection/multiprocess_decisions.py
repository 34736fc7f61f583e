"""One process of a 2-process CPU job (jax.distributed, gloo): traces and
runs the drop-in dot_general (all-gather and reduce-scatter patterns) over a
mesh spanning both processes, and writes what it decided to a JSON file.

  python multiprocess_decisions.py PROCESS_ID PORT OUT.json
(COLLECTIVE_MATMUL_TUNING_CACHE may point at a per-process cache file;
CM_FAKE_NCCL=X.Y.Z, or "none", stands for the NCCL this process loaded, and
the file also holds what `auto` decides for a Hopper ring over all 8 devices
of both processes from the job's NCCL, `selection.job_nccl_version`.)
"""
import json
import os
import sys

# Custom calls out of XLA's command buffers: the NCCL rule's decision does
# not then depend on whether this JAX's kernels are checked under capture.
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 "
                           "--xla_gpu_enable_command_buffer=-CUSTOM_CALL")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # pylint: disable=g-import-not-at-top
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

import collective_matmul as cm  # pylint: disable=g-import-not-at-top
from collective_matmul import selection  # pylint: disable=g-import-not-at-top

process_id, port, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=2,
                           process_id=process_id)
assert jax.device_count() == 8 and jax.local_device_count() == 4

mesh = jax.make_mesh((2, 4), ("data", "tensor"),
                     axis_types=(AxisType.Explicit,) * 2)
rng = np.random.default_rng(0)  # Same data on both processes.
x_host = rng.standard_normal((4, 32, 64)).astype(np.float32)
wi_host = rng.standard_normal((64, 32)).astype(np.float32) / 8
wo_host = rng.standard_normal((32, 64)).astype(np.float32) / 8


def put(array, spec):
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(array.shape, sharding,
                                      lambda index: array[index])


dims = (((2,), (0,)), ((), ()))
with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="auto"):
  x = put(x_host, P("data", "tensor", None))
  wi = put(wi_host, P(None, "tensor"))
  wo = put(wo_host, P("tensor", None))

  @jax.jit
  def mlp(x, wi, wo):
    h = cm.dot_general(x, wi, dims, out_sharding=P("data", None, "tensor"),
                       name="wi")
    return cm.dot_general(jax.nn.gelu(h), wo, dims,
                          out_sharding=P("data", "tensor", None), name="wo")

  y = mlp(x, wi, wo)

fake = os.environ.get("CM_FAKE_NCCL")
nccl = {}
if fake:
  from collective_matmul.enums import Collective  # pylint: disable=g-import-not-at-top
  from collective_matmul.selection import device as device_lib  # pylint: disable=g-import-not-at-top
  own = None if fake == "none" else tuple(int(x) for x in fake.split("."))
  device_lib.loaded_nccl_version = lambda: own
  device_lib.job_nccl_version.cache_clear()
  job = device_lib.job_nccl_version()
  facts = selection.DeviceFacts("gpu", "NVIDIA H100 80GB HBM3", 132,
                                jax.process_count(), jax.local_device_count(),
                                job)
  plan = selection.choose("auto", Collective.ALL_GATHER, selection.Problem(
      4096, 4096, 4096, np.dtype("bfloat16"), 8), facts)
  nccl = {"own": own, "job": job, "impl": plan.impl.value,
          "reason": plan.reason}

reference = np.asarray(jax.nn.gelu(x_host @ wi_host) @ wo_host)
max_err = max(float(np.max(np.abs(np.asarray(s.data) - reference[s.index])))
              for s in y.addressable_shards)
with open(out_path, "w") as f:
  json.dump({
      "decisions": [str(d) for d in cm.decisions()],
      "config": selection.select_config(256, 512, 1024, "bfloat16", 4).to_json(),
      "max_abs_error": max_err,
      "nccl": nccl,
  }, f)
jax.distributed.shutdown()
