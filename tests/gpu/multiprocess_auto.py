"""multiprocess_check.py's CM_MP_AUTO mode: one process of a 2-process job
(a ring over both), what `auto` decides and whether it is right.

Prints `DECIDE ...` (the NCCL each process loaded and the job's lowest,
the plans), then `OK <case> calls N worst <err>` per case, or exits 1 with
`WRONG <case> ...`. Cases, each CM_MP_CALLS calls of one compiled program
(fresh operands every 4th call and parameters from the last call, the same
buffers replayed in between), each against XLA's baseline on the same
inputs:
  bf16_train  an MLP (all-gather pattern -> gelu -> reduce-scatter
              pattern) through the drop-in dot_general under impl="auto",
              value_and_grad and an SGD update; baseline: the plugin off;
  fp8_<op>    cm.all_gather_matmul (e4m3 x e4m3) and
              cm.matmul_reduce_scatter (e5m2 x e4m3) with a scale under the
              plan `auto` chose, value_and_grad of a weighted sum; baseline:
              impl="baseline".
"""
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import collective_matmul as cm
from collective_matmul import plan as plan_lib
from collective_matmul import selection
from collective_matmul.enums import Collective

BF16_TOLERANCE = 2e-2   # A training step's chained bf16 roundings.
FP8_TOLERANCE = 0.06    # One e4m3 rounding of a gradient (2^-4 roundoff).


def _rel(a, b):
  a = np.asarray(a, np.float32)
  b = np.asarray(b, np.float32)
  if not np.isfinite(a).all():
    return float("inf")
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _global(local, mesh, spec, dtype):
  """The global array whose shard on this process is `local`."""
  return jax.make_array_from_process_local_data(
      NamedSharding(mesh, spec), np.asarray(local).astype(dtype))


def _local(x):
  return np.asarray(x.addressable_shards[0].data).astype(np.float32)


def _loop(name, step_on, step_off, params, fresh, calls, tolerance,
          next_params):
  """Runs both steps `calls` times on the same inputs; exits on a miss."""
  worst = 0.0
  for i in range(calls):
    if i % 4 == 0:
      if i:
        params = next_params(params, out)
      operands = (params, fresh(i))
      ref = step_off(*operands)
    out = step_on(*operands)
    errs = [_rel(_local(a), _local(b)) for a, b in zip(
        jax.tree.leaves(out), jax.tree.leaves(ref))]
    if not all(np.isfinite(errs)):
      print(f"{name} call {i}: errors {errs}", flush=True)
    worst = max(worst, max(errs))
  status = "OK" if worst <= tolerance else "WRONG"
  print(f"{status} {name} calls {calls} worst {worst:.3e}", flush=True)
  if status != "OK":
    sys.exit(1)


def _bf16_train(mesh, rng, calls):
  m, k, f = 1024, 2048, 2048  # Per process: rows; model dim; hidden columns.
  i = jax.process_index()
  dims = (((1,), (0,)), ((), ()))

  def put(local, spec):
    return _global(local, mesh, spec, jnp.bfloat16)

  wi = put(rng.standard_normal((k, f)) / 45, P(None, "x"))
  wo = put(rng.standard_normal((f, k)) / 45, P("x", None))

  def loss(params, x):
    wi, wo = params
    h = cm.dot_general(x, wi, dims, out_sharding=P(None, "x"), name="wi")
    h = jax.nn.gelu(h.astype(jnp.float32)).astype(jnp.bfloat16)
    y = cm.dot_general(h, wo, dims, out_sharding=P("x", None), name="wo")
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return value, grads

  def fresh(call):
    local = np.random.default_rng(100 + call).standard_normal((2 * m, k))
    return put(local[i * m:(i + 1) * m], P("x", None))

  params = (wi, wo)
  compiled = {}
  for enabled in (True, False):
    cm.clear_decisions()
    with cm.config_context(enabled=enabled, impl="auto"):
      compiled[enabled] = jax.jit(step).lower(params, fresh(0)).compile()
    if enabled:
      decided = [str(d) for d in cm.decisions()]
      print("DECIDE bf16_train", decided, flush=True)
  text = compiled[True].as_text()
  print(f"DECIDE bf16_train kernels in the compiled step: "
        f"{text.count('mosaic_gpu')}", flush=True)

  def sgd(params, out):
    _, grads = out
    return jax.tree.map(lambda p, g: (p - 0.5 * g).astype(p.dtype), params,
                        grads)
  _loop("bf16_train", compiled[True], compiled[False], params, fresh, calls,
        BF16_TOLERANCE, sgd)


def _fp8_case(mesh, rng, calls, collective):
  e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
  m, k, n = 1024, 2048, 1024
  op = (cm.all_gather_matmul if collective == Collective.ALL_GATHER
        else cm.matmul_reduce_scatter)
  lhs_dtype = e4m3 if collective == Collective.ALL_GATHER else e5m2
  d = jax.process_count()
  if collective == Collective.ALL_GATHER:
    x_shape, x_spec, w_spec, out_spec = (m, k), P("x", None), P(None, "x"), \
        P(None, "x")
  else:
    x_shape, x_spec, w_spec, out_spec = (d * m, k), P(None, "x"), \
        P("x", None), P("x", None)
  rows, per_batch = plan_lib.kernel_rows(collective, x_shape, 0, d)
  problem = selection.Problem(rows, k, n, np.dtype(lhs_dtype), d,
                              np.dtype(jnp.bfloat16), np.dtype(e4m3),
                              per_batch)
  chosen = selection.choose("auto", collective, problem,
                            selection.device_facts())
  print(f"DECIDE fp8_{collective.value} {chosen.impl.value} / backward "
        f"{chosen.backward_impl.value}: {chosen.reason}", flush=True)
  scale = _global(np.float32(0.75 * 1.25), mesh, P(), jnp.float32)
  i = jax.process_index()

  def put(local, spec, dtype):
    return _global(local, mesh, spec, dtype)

  def program(**how):
    body = functools.partial(op, axis_name="x",
                             preferred_element_type=jnp.bfloat16, **how)
    f = jax.shard_map(lambda a, w, t, s: jax.lax.psum(jnp.sum(
        body(a, w, scale=s).astype(jnp.float32) * t), "x"),
                      in_specs=(x_spec, w_spec, out_spec, P()),
                      out_specs=P(), check_vma=False)
    return jax.jit(lambda params, t: jax.value_and_grad(
        lambda a, w: f(a, w, t, scale), (0, 1))(*params))

  w_local = rng.standard_normal((k // d if collective ==
                                 Collective.REDUCE_SCATTER else k,
                                 n if collective == Collective.REDUCE_SCATTER
                                 else n))
  # The all-gather's weight: [k, n] per process (columns sharded); the
  # reduce-scatter's: [k / d, n] per process (rows sharded).
  w = put(w_local, w_spec, e4m3)

  def fresh(call):
    local_rng = np.random.default_rng(200 + call)
    full = local_rng.standard_normal((d * m, k))
    a_local = (full[i * m:(i + 1) * m] if collective == Collective.ALL_GATHER
               else full[:, i * (k // d):(i + 1) * (k // d)])
    t_full = local_rng.standard_normal((d * m, n)) / 8
    t_local = (t_full if collective == Collective.ALL_GATHER
               else t_full[i * m:(i + 1) * m])
    a = put(a_local, x_spec, lhs_dtype)
    t = _global(t_local, mesh, out_spec, jnp.float32)
    return a, t

  def step(on):
    prog = program(plan=chosen) if on else program(impl="baseline")

    def run(params, inputs):
      a, t = inputs
      return prog((a, params), t)
    return run

  def keep(params, out):
    return params

  _loop(f"fp8_{collective.value}", step(True), step(False), w, fresh, calls,
        FP8_TOLERANCE, keep)


def run(mesh, rng, calls):
  facts = selection.device_facts()
  print(f"DECIDE nccl loaded {selection.loaded_nccl_version()} job "
        f"{facts.nccl_version} facts {facts}", flush=True)
  with jax.set_mesh(mesh):
    _bf16_train(mesh, rng, calls)
    for collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
      _fp8_case(mesh, rng, calls, collective)
