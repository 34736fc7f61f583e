"""Not a device run: the tracing test's configs (tests/kernels/test_kernel_tracing.py),
interpreted on CPU at D = 1 over 4 odd shapes (JAX 0.12, Mosaic GPU interpret
mode, races detected). Run from the repo root with PYTHONPATH=plugin:host and
XLA_FLAGS=--xla_force_host_platform_device_count=8; eleventh session, cb863c1."""
import sys, time, functools, itertools
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/kernels")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from collective_matmul import kernels, selection
import test_kernel_tracing as t
mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Explicit,))
shapes = [(300, 256, 384), (64, 64, 64), (130, 72, 200), (512, 448, 128)]
bad = 0
cases = [("ag", kernels.all_gather_lhs_matmul, c) for c in t.CONFIGS] + [("rs", kernels.matmul_reduce_scatter, c) for c in t.RS_CONFIGS]
for (kind, kern, cfg), (m, k, n) in itertools.product(cases, shapes):
  if cfg is None:
    cfg = (selection.select_config if kind == "ag" else selection.select_reduce_scatter_config)(m, k, n, jnp.bfloat16, 2)
  a = jax.random.normal(jax.random.key(m + k), (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(jax.random.key(n), (k, n), jnp.float32).astype(jnp.bfloat16)
  t0 = time.time()
  try:
    with jax.set_mesh(mesh), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
      f = jax.jit(jax.shard_map(functools.partial(kern, axis_name="x", config=cfg), in_specs=(P(), P()), out_specs=P(), check_vma=False))
      out = np.asarray(f(a, b), np.float32)
    ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    err = float(np.linalg.norm(np.nan_to_num(out, nan=1e9) - ref) / np.linalg.norm(ref))
    ok = err < 5e-3
    status = f"err {err:.1e}"
  except Exception as e:
    gpu_callbacks.reset_gpu_interpret_mode_state()
    ok, status = False, f"{type(e).__name__}: {str(e)[:300]}"
  bad += not ok
  print(f"{'ok ' if ok else 'BAD'} {kind} {m}/{k}/{n} {status} {time.time()-t0:.1f}s {cfg}", flush=True)
print("bad", bad)
