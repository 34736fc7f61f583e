"""One process per GPU (jax.distributed): both kernels over 2 processes.

Run as two processes with RANK=0 and RANK=1. Environment knobs (for the
diagnostics in tools/gpu_multiprocess_diag.sh):
  CM_MP_DEVICES=visible  each process sees only its GPU (CUDA_VISIBLE_DEVICES
                         set by the launcher); default: local_device_ids.
  CM_MP_NVSHMEM=1        Mosaic GPU reaches peers through NVSHMEM
                         (`--xla_gpu_experimental_enable_nvshmem`).
  CM_MP_CONTROL=1        only an XLA all-gather (is multi-process NCCL fine?).
  CM_MP_PORT             coordinator port (default 12731).
  CM_MP_DIRECT=1         call the kernels directly (`collective_matmul.kernels`
                         at `selection`'s config), past the ops' refusal of a
                         ring that spans processes: to try that path.
  CM_MP_AUTO=1           what `auto` decides here (the NCCL the processes
                         loaded, `selection.device_facts`), then a bf16
                         training step through the drop-in dot_general and
                         fp8 ops (forward and gradients) under that
                         decision, CM_MP_CALLS calls (default 24: fresh
                         operands every 4th, replays in between), each
                         against XLA's baseline on the same inputs.
XLA_FLAGS are left as given (XLA's command buffers on by default) unless
this JAX's kernels are unchecked under them (`prepare_xla_for_kernels`).
"""
import functools
import os
import sys

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if os.environ.get("CM_MP_NVSHMEM") == "1":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_gpu_experimental_enable_nvshmem=true")
import collective_matmul as cm

cm.prepare_xla_for_kernels()
import jax

RANK = int(os.environ["RANK"])
kwargs = {}
if os.environ.get("CM_MP_DEVICES") != "visible":
  kwargs["local_device_ids"] = [RANK]
jax.distributed.initialize(
    f"localhost:{os.environ.get('CM_MP_PORT', '12731')}", num_processes=2,
    process_id=RANK, **kwargs)
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

print("process", jax.process_index(), "devices", jax.local_devices(),
      "of", jax.devices(), flush=True)
mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
m, k, n = 1024, 2048, 1024
i = jax.process_index()
rng = np.random.default_rng(0)
a_full = rng.standard_normal((2 * m, k)).astype(np.float32)
b_full = rng.standard_normal((k, 2 * n)).astype(np.float32)
rounded = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)


def global_array(local, spec):
  return multihost_utils.host_local_array_to_global_array(
      jnp.asarray(local, jnp.bfloat16), mesh, spec)


def check(name, fn, args, ref):
  if name != "xla_all_gather":
    hlo = fn.lower(*args).as_text()
    assert "mosaic_gpu" in hlo, f"{name}: the Pallas kernel was not used"
  out = fn(*args)
  local = np.asarray(out.addressable_shards[0].data, np.float32)
  assert np.isfinite(local).all(), f"{name}: non-finite output"
  err = np.linalg.norm(local - ref) / np.linalg.norm(ref)
  assert err < 1e-2, (name, err)
  print(f"OK {name} rel_err {err:.3e}", flush=True)


with jax.set_mesh(mesh):
  a = global_array(a_full[i * m:(i + 1) * m], P("x", None))
  if os.environ.get("CM_MP_CONTROL") == "1":
    f = jax.jit(jax.shard_map(
        lambda x: jax.lax.all_gather(x, "x", tiled=True),
        out_specs=P(None), check_vma=False))
    check("xla_all_gather", f, (a,), rounded(a_full))
    sys.exit(0)
  if os.environ.get("CM_MP_AUTO") == "1":
    import multiprocess_auto  # pylint: disable=g-import-not-at-top
    multiprocess_auto.run(mesh, rng, int(os.environ.get("CM_MP_CALLS", "24")))
    sys.exit(0)
  direct = os.environ.get("CM_MP_DIRECT") == "1"
  if direct:
    from collective_matmul import kernels, selection  # pylint: disable=g-import-not-at-top
    facts = selection.DeviceFacts("gpu", jax.devices()[0].device_kind, 132)
  # All-gather kernel: all_gather(a) @ b[:, this device's columns].
  b = global_array(b_full[:, i * n:(i + 1) * n], P(None, "x"))
  ag = (functools.partial(
      kernels.all_gather_lhs_matmul, axis_name="x",
      config=selection.select_config(m, k, n, jnp.bfloat16, 2, facts))
        if direct else functools.partial(cm.all_gather_matmul,
                                         axis_name="x", impl="pallas"))
  f = jax.jit(jax.shard_map(ag, out_specs=P(None, "x"), check_vma=False))
  check("all_gather_matmul", f, (a, b),
        rounded(a_full) @ rounded(b_full[:, i * n:(i + 1) * n]))
  # Reduce-scatter kernel: x [2m, k/2 local] @ w [k/2 local, n].
  kh = k // 2
  x = global_array(a_full[:, i * kh:(i + 1) * kh], P(None, "x"))
  w = global_array(b_full[i * kh:(i + 1) * kh, :n], P("x", None))
  rs = (functools.partial(
      kernels.matmul_reduce_scatter, axis_name="x",
      config=selection.select_reduce_scatter_config(m, kh, n, jnp.bfloat16,
                                                    2, facts))
        if direct else functools.partial(cm.matmul_reduce_scatter,
                                         axis_name="x", impl="pallas"))
  g = jax.jit(jax.shard_map(rs, out_specs=P("x", None), check_vma=False))
  check("matmul_reduce_scatter", g, (x, w),
        (rounded(a_full) @ rounded(b_full[:, :n]))[i * m:(i + 1) * m])
  if not direct:
    sys.exit(0)
  # fp8 (direct only): the all-gather e4m3 x e4m3, the reduce-scatter
  # e5m2 x e4m3, the weight K-major ([n, k]), a per-tensor scale, bf16
  # results, against the f32 product of the same fp8 values.
  e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
  scale = np.float32(0.75 * 1.25)
  as_fp8 = lambda x, dt: np.asarray(jnp.asarray(x, dt), np.float32)

  def fp8_global(local, spec, dt):
    return multihost_utils.host_local_array_to_global_array(
        jnp.asarray(local, dt), mesh, spec)

  bt = b_full.T  # [2n, k]: the weight K-major.
  a8 = fp8_global(a_full[i * m:(i + 1) * m], P("x", None), e4m3)
  b8 = fp8_global(bt[i * n:(i + 1) * n], P("x", None), e4m3)
  ag8 = functools.partial(
      kernels.all_gather_lhs_matmul, axis_name="x", weight_layout="nk",
      config=selection.select_config(m, k, n, e4m3, 2, facts,
                                     out_dtype=jnp.bfloat16, rhs_dtype=e4m3))
  f8 = jax.jit(jax.shard_map(lambda a, b: ag8(a, b, scale=jnp.float32(scale)),
                             out_specs=P(None, "x"), check_vma=False))
  check("all_gather_matmul_fp8", f8, (a8, b8),
        scale * as_fp8(a_full, e4m3) @ as_fp8(bt[i * n:(i + 1) * n], e4m3).T)
  x8 = fp8_global(a_full[:, i * kh:(i + 1) * kh], P(None, "x"), e5m2)
  w8 = fp8_global(bt[:n, i * kh:(i + 1) * kh], P(None, "x"), e4m3)
  rs8 = functools.partial(
      kernels.matmul_reduce_scatter, axis_name="x", weight_layout="nk",
      config=selection.select_reduce_scatter_config(
          m, kh, n, e5m2, 2, facts, out_dtype=jnp.bfloat16, rhs_dtype=e4m3))
  g8 = jax.jit(jax.shard_map(lambda x, w: rs8(x, w, scale=jnp.float32(scale)),
                             out_specs=P("x", None), check_vma=False))
  check("matmul_reduce_scatter_fp8", g8, (x8, w8),
        (scale * as_fp8(a_full, e5m2) @ as_fp8(bt[:n], e4m3).T)
        [i * m:(i + 1) * m])
