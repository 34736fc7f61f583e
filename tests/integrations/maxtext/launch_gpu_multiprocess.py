"""One process of the plugin's MaxText launcher in a job of one process per
"GPU" (`hardware=gpu_multiprocess`), on CPU, for
test_gpu_multiprocess_launcher.py:

    CM_FAKE_NCCL=X.Y.Z|none CM_DECISIONS_OUT=OUT.json \\
        python launch_gpu_multiprocess.py <MaxText and plugin arguments>

MaxText calls `jax.distributed.initialize()` without arguments; JAX finds
the job from the environment (the test sets SLURM's variables). What is
stood in for, nothing else:
- `selection.device.loaded_nccl_version` returns CM_FAKE_NCCL (what this
  process's libnccl would say; "none": unknown). `job_nccl_version` is the
  real one: each process publishes its own in jax.distributed's key-value
  store and takes the lowest.
- `selection.device_facts` reads the default backend's facts (not the
  mesh's abstract device, which says "cpu"), `selection.device` seeing
  `jax.default_backend()` as "gpu", with an H100's device kind and SM count.
  So the platform is "gpu" and `device_facts` itself asks for the job's
  NCCL, and `auto` reaches the rule on a ring across processes instead of
  stopping at "backend is 'cpu'". The process count and local device count
  are the job's. The tiny model's projections are all too small for the
  kernel, so every decision is XLA's collective + GEMM (the baseline),
  which runs on CPU.
After the run (also a failed one) CM_DECISIONS_OUT holds every decision
(`str` of `cm.decisions()`), this process's and the job's NCCL version, the
facts the decisions read and where `collective_matmul` was imported from.
"""
import dataclasses
import json
import os
import runpy
import sys

import jax

import collective_matmul as cm
from collective_matmul import selection
from collective_matmul.selection import device as device_lib

_FAKE = os.environ["CM_FAKE_NCCL"]
OWN = None if _FAKE == "none" else tuple(int(x) for x in _FAKE.split("."))
device_lib.loaded_nccl_version = lambda: OWN

class _JaxOnGpu:
  """`jax` as `selection.device` sees it: the default backend is "gpu"."""

  def __getattr__(self, name):
    return getattr(jax, name)

  def default_backend(self):
    return "gpu"


device_lib.jax = _JaxOnGpu()
_real_device_facts = selection.device_facts
_facts_seen = []


def hopper_facts(mesh=None):
  # The real facts of the default backend, not of the mesh (whose abstract
  # device says "cpu"): platform "gpu" from the backend above, the process
  # layout, the job's NCCL as device_facts asks for it; H100s' kind.
  del mesh
  facts = dataclasses.replace(_real_device_facts(None),
                              device_kind="NVIDIA H100 80GB HBM3",
                              num_cores=132)
  record = dataclasses.asdict(facts)
  if record not in _facts_seen:
    _facts_seen.append(record)
  return facts


selection.device_facts = hopper_facts


def _write_out():
  with open(os.environ["CM_DECISIONS_OUT"], "w") as f:
    json.dump({
        "plugin_file": cm.__file__,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_device_count": jax.local_device_count(),
        "own_nccl": OWN,
        # What the decisions read (None where none asked: no exchange
        # after the run, the other process may be gone).
        "job_nccl": (device_lib.job_nccl_version()
                     if device_lib.job_nccl_version.cache_info().currsize
                     else None),
        "facts": _facts_seen,
        "decisions": [str(d) for d in cm.decisions()],
    }, f, indent=1)


sys.argv = ["collective_matmul.integrations.maxtext", *sys.argv[1:]]
try:
  runpy.run_module("collective_matmul.integrations.maxtext",
                   run_name="__main__", alter_sys=True)
finally:
  _write_out()
