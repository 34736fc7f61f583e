"""One process per GPU (jax.distributed): the kernel over 2 processes."""
import functools
import os

# Multi-process Mosaic GPU collectives reach peers through NVSHMEM (as the
# upstream collective-matmul example does); NVLS stays off.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_gpu_experimental_enable_nvshmem=true")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
import jax

RANK = int(os.environ["RANK"])
jax.distributed.initialize("localhost:12731", num_processes=2,
                           process_id=RANK, local_device_ids=[RANK])
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

import collective_matmul as cm

mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
m, k, n = 512, 2048, 1024
rng = np.random.default_rng(0)
a_full = rng.standard_normal((2 * m, k)).astype(np.float32)
b_full = rng.standard_normal((k, 2 * n)).astype(np.float32)
with jax.set_mesh(mesh):
  a = multihost_utils.host_local_array_to_global_array(
      jnp.asarray(a_full[jax.process_index() * m:][:m], jnp.bfloat16), mesh,
      P("x", None))
  b = multihost_utils.host_local_array_to_global_array(
      jnp.asarray(b_full[:, jax.process_index() * n:][:, :n], jnp.bfloat16),
      mesh, P(None, "x"))
  f = jax.jit(jax.shard_map(
      functools.partial(cm.all_gather_matmul, axis_name="x", impl="pallas"),
      out_specs=P(None, "x"), check_vma=False))
  out = f(a, b)
  local = np.asarray(out.addressable_shards[0].data, np.float32)
  i = jax.process_index()
  ref = (a_full.astype(jnp.bfloat16).astype(np.float32)
         @ b_full[:, i * n:(i + 1) * n].astype(jnp.bfloat16).astype(np.float32))
  err = np.linalg.norm(local - ref) / np.linalg.norm(ref)
  assert err < 1e-2, err
  print("OK rel_err", err, flush=True)
