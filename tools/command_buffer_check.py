"""The kernels under XLA's command buffers (CUDA-graph capture and replay),
on one GPU, with XLA_FLAGS as given (default: XLA's own, which capture
custom calls).

Arms, each a jitted program called `--calls` times: after every 4 calls
with fresh operands come replays of the same buffers, each result against
a reference computed on the same inputs:
  ops_d1          a training step (all-gather matmul -> gelu -> matmul
                  reduce-scatter, `jax.value_and_grad`, SGD update) through
                  the public ops with impl="pallas" on a one-device mesh,
                  against the same step with impl="baseline" (XLA);
  virtual_d{2,4}  the rings as D virtual ranks (`kernels.*_virtual`) in a
                  training-like step: forward all-gather matmul, gelu,
                  reduce-scatter; backward the two again (dh, dx), XLA's
                  dots for dw, an SGD update; against f32 einsums of the
                  same bf16 values;
  fp8_d2          both fp8 rings (e4m3 x e4m3 all-gather, e5m2 x e4m3
                  reduce-scatter, a scale) with elementwise work around;
  mutation_d2     the all-gather ring without its tile wait (the receiver
                  run ahead): it must fail, so the check can fail.
With `--dump DIR` XLA dumps the optimized HLO and the summary says, per
arm, how many kernels XLA placed inside command buffers (proof of
capture; `xla_capture.py`).

  python tools/command_buffer_check.py --out cb.json --dump /tmp/dump
  python tools/command_buffer_check.py --plan   # CPU: trace every arm
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = 2e-2  # bf16 roundings of chained products (relative, norm).
ARMS = ("ops_d1", "virtual_d2", "virtual_d4", "fp8_d2", "mutation_d2")


def _setup_env(dump):
  flags = os.environ.get("XLA_FLAGS", "")
  if dump:
    flags += f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
  os.environ["XLA_FLAGS"] = flags.strip()
  os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
  os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
  sys.path.insert(0, TOOLS_DIR)
  sys.path.insert(0, os.path.join(os.path.dirname(TOOLS_DIR), "plugin"))


def _rel(a, b):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  bad = ~jnp.all(jnp.isfinite(a))
  err = jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)
  return jnp.where(bad, jnp.inf, err)


# ------------------------------------------------------------- the arms


def _ops_d1_arm(seed, impl="pallas"):
  """(step_kernel, step_reference, initial args, fresh(args, i)) of the
  training step through the public ops at D = 1."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import collective_matmul as cm  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",),
                           axis_types=(jax.sharding.AxisType.Auto,))
  rows, e, f = 2048, 2048, 4096

  def make(impl):
    def ag(x, w):
      return jax.shard_map(
          lambda x, w: cm.all_gather_matmul(x, w, "x", impl=impl), mesh=mesh,
          in_specs=(P("x", None), P(None, "x")), out_specs=P(None, "x"),
          check_vma=False)(x, w)

    def rs(h, w):
      return jax.shard_map(
          lambda h, w: cm.matmul_reduce_scatter(h, w, "x", impl=impl),
          mesh=mesh, in_specs=(P(None, "x"), P("x", None)),
          out_specs=P("x", None), check_vma=False)(h, w)

    def loss(params, x):
      wi, wo = params
      h = jax.nn.gelu(ag(x, wi).astype(jnp.float32)).astype(jnp.bfloat16)
      y = rs(h, wo).astype(jnp.float32)
      return jnp.mean(jnp.square(y))

    def cbcheck_ops_step(params, x):
      value, grads = jax.value_and_grad(loss)(params, x)
      new = jax.tree.map(lambda p, g: (p - 0.1 * g).astype(p.dtype), params,
                         grads)
      return value, grads, new
    return jax.jit(cbcheck_ops_step)

  keys = jax.random.split(jax.random.key(seed), 3)
  params = ((jax.random.normal(keys[0], (e, f)) / 45).astype(jnp.bfloat16),
            (jax.random.normal(keys[1], (f, e)) / 64).astype(jnp.bfloat16))

  def fresh(i):
    return jax.random.normal(jax.random.fold_in(keys[2], i), (rows, e),
                             jnp.bfloat16)
  return mesh, make(impl), make("baseline"), params, fresh


def _virtual_arm(d, seed, mutated=False):
  """The training-like step on D virtual ranks and its f32 reference."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from collective_matmul import kernels  # pylint: disable=g-import-not-at-top
  from collective_matmul.kernels import peers  # pylint: disable=g-import-not-at-top
  m, e, f = 1024, 2048, 1024  # Per rank: rows, model dim, hidden columns.
  shares = (132 // d,) * d
  drop = frozenset(["ag_tile_wait"]) if mutated else frozenset()
  delay = (0, 2_000_000) + (0,) * (d - 2) if mutated else ()
  ranks = peers.VirtualRanks(d, shares, delay, drop)
  ag = functools.partial(kernels.all_gather_lhs_matmul_virtual, ranks=ranks,
                         config=kernels.AllGatherConfig())
  rs = functools.partial(kernels.matmul_reduce_scatter_virtual, ranks=ranks,
                         config=kernels.ReduceScatterConfig())
  hi = jax.lax.Precision.HIGHEST
  bf16 = jnp.bfloat16

  def ag_ref(x, w):  # x [D, m, k], w [D, k, n] -> [D, D*m, n]
    return jnp.einsum("rk,dkn->drn", x.reshape(-1, x.shape[-1]).astype(
        jnp.float32), w.astype(jnp.float32), precision=hi).astype(bf16)

  def rs_ref(x, w):  # x [D, D*m, k], w [D, k, n] -> [D, m, n]
    total = jnp.einsum("drk,dkn->rn", x.astype(jnp.float32),
                       w.astype(jnp.float32), precision=hi)
    return total.reshape(d, -1, total.shape[-1]).astype(bf16)

  def make(ag_fn, rs_fn):
    def cbcheck_virtual_step(x, w1, w2):
      pre = (x.astype(jnp.float32) * 1.0625).astype(bf16)
      y = ag_fn(pre, w1)                                   # [D, D*m, f]
      h = jax.nn.gelu(y.astype(jnp.float32)).astype(bf16)
      z = rs_fn(h, w2)                                     # [D, m, e]
      loss = jnp.mean(jnp.square(z.astype(jnp.float32)))
      dz = (2.0 / z.size * z.astype(jnp.float32)).astype(bf16)
      dh = ag_fn(dz, jnp.swapaxes(w2, 1, 2))               # [D, D*m, f]
      _, gelu_vjp = jax.vjp(jax.nn.gelu, y.astype(jnp.float32))
      dy = gelu_vjp(dh.astype(jnp.float32))[0].astype(bf16)
      dx = rs_fn(dy, jnp.swapaxes(w1, 1, 2))                # [D, m, e]
      gathered = pre.reshape(-1, pre.shape[-1])
      dw1 = jnp.einsum("rk,drn->dkn", gathered, dy,
                       preferred_element_type=jnp.float32)
      dw2 = jnp.einsum("drf,dre->dfe", h, _full_rows(dz, d),
                       preferred_element_type=jnp.float32)
      new_w1 = (w1.astype(jnp.float32) - 1e-3 * dw1).astype(bf16)
      new_w2 = (w2.astype(jnp.float32) - 1e-3 * dw2).astype(bf16)
      return (loss, z, dx), (new_w1, new_w2)
    return jax.jit(cbcheck_virtual_step)

  keys = jax.random.split(jax.random.key(seed), 3)
  w1 = (jax.random.normal(keys[0], (d, e, f)) / 45).astype(bf16)
  w2 = (jax.random.normal(keys[1], (d, f, e)) / 32).astype(bf16)

  def fresh(i):
    return jax.random.normal(jax.random.fold_in(keys[2], i), (d, m, e), bf16)
  return make(ag, rs), make(ag_ref, rs_ref), (w1, w2), fresh


def _full_rows(dz, d):
  """[D, m, e] per-rank rows -> [D, D*m, e]: every rank's copy of all rows
  (the rows each rank's h holds)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  full = dz.reshape(-1, dz.shape[-1])
  return jnp.broadcast_to(full, (d,) + full.shape)


def _fp8_arm(seed):
  """Both fp8 rings at D = 2 in one program with elementwise work around,
  and the f32 reference of the same fp8 values (rings_one_gpu's)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from collective_matmul import kernels  # pylint: disable=g-import-not-at-top
  import rings_one_gpu as rings  # pylint: disable=g-import-not-at-top
  programs = [rings._program(rings.Case(  # pylint: disable=protected-access
      f"{kind}/cb/d2/fp8", kind, 2, 1024, 2048, 1024, "fp8", config))
              for kind, config in (
                  ("all_gather", kernels.AllGatherConfig(tile_k=128)),
                  ("reduce_scatter", kernels.ReduceScatterConfig(tile_k=128)))]

  def make(which):
    def cbcheck_fp8_step(args):
      outs = []
      for (fn, _, ref), operands in zip(programs, args):
        out = (ref if which == "reference" else fn)(*operands)
        outs.append(out.astype(jnp.float32) * 0.5 + 1.0)
      return tuple(outs), ()
    return jax.jit(cbcheck_fp8_step)

  def fresh(i):
    return tuple(tuple(rings._operands(specs, seed + 7 * i + j))  # pylint: disable=protected-access
                 for j, (_, specs, _) in enumerate(programs))
  return make("kernel"), make("reference"), (), fresh


# ------------------------------------------------------------- the loop


def _run_arm(name, step, reference, params, fresh, calls):
  """Calls `step` `calls` times (fresh operands every 4th call and params
  updated from the last call; the same buffers replayed in between), each
  result against `reference` on the same inputs: per-call worst relative
  error of the arm's outputs."""
  import jax  # pylint: disable=g-import-not-at-top
  errors, ref_out = [], None
  for i in range(calls):
    if i % 4 == 0:
      if i and params:
        params = new_params
      operands = (params, fresh(i)) if name == "ops_d1" else (
          (fresh(i),) + tuple(params) if params else (fresh(i),))
      ref_out = reference(*operands)[0] if name != "ops_d1" else (
          reference(*operands)[:2])
    out = step(*operands)
    got = out[:2] if name == "ops_d1" else out[0]
    if name != "ops_d1":
      new_params = out[1]
    else:
      new_params = out[2]
    worst = max(float(_rel(a, b)) for a, b in zip(
        jax.tree.leaves(got), jax.tree.leaves(ref_out)))
    errors.append(worst)
  return errors


def run(arms, calls, seed=0):
  import jax  # pylint: disable=g-import-not-at-top
  results = []
  for arm in arms:
    start = time.perf_counter()
    if arm == "ops_d1":
      mesh, step, reference, params, fresh = _ops_d1_arm(seed)
      with jax.set_mesh(mesh):
        errors = _run_arm(arm, step, reference, params, fresh, calls)
    elif arm.startswith(("virtual_", "mutation_")):
      d = int(arm.rsplit("_d", 1)[1])
      step, reference, params, fresh = _virtual_arm(
          d, seed, mutated=arm.startswith("mutation"))
      errors = _run_arm(arm, step, reference, params, fresh, calls)
    else:
      step, reference, params, fresh = _fp8_arm(seed)
      errors = _run_arm(arm, step, reference, params, fresh, calls)
    worst = max(errors)
    expect_fail = arm.startswith("mutation")
    wrong = worst > TOLERANCE
    results.append(dict(
        arm=arm, calls=calls, worst_rel_error=worst, errors=errors,
        expect_fail=expect_fail, status=("caught" if expect_fail and wrong
                                         else "MISSED" if expect_fail
                                         else "WRONG" if wrong else "ok"),
        seconds=round(time.perf_counter() - start, 1)))
    print(f"{arm:14s} {results[-1]['status']:7s} worst {worst:.3e} over "
          f"{calls} calls ({results[-1]['seconds']} s)", flush=True)
  return results


def plan(arms):
  """Traces every arm's programs without a GPU (the ops arm with
  impl="ring": the ops refuse pallas off a GPU) and, on JAX >= 0.12, lowers
  the kernels' programs for CUDA."""
  import jax  # pylint: disable=g-import-not-at-top
  version = tuple(int(x) for x in jax.__version__.split(".")[:2])
  lower = version >= (0, 12)
  lines = []
  for arm in arms:
    if arm == "ops_d1":
      mesh, _, reference, params, fresh = _ops_d1_arm(0, impl="ring")
      with jax.set_mesh(mesh):
        reference.trace(params, fresh(0))
      lines.append(f"{arm}: traced (ring)")
      continue
    if arm == "fp8_d2":
      if version < (0, 11):
        lines.append(f"{arm}: skipped (its e5m2 x e4m3 reduce-scatter needs "
                     "JAX >= 0.11)")
        continue
      step, _, _, fresh = _fp8_arm(0)
      traced = step.trace(fresh(0))
    else:
      d = int(arm.rsplit("_d", 1)[1])
      step, _, params, fresh = _virtual_arm(
          d, 0, mutated=arm.startswith("mutation"))
      traced = step.trace(fresh(0), *params)
    if lower:
      traced.lower(lowering_platforms=("cuda",))
    lines.append(f"{arm}: traced" + (", lowered for CUDA" if lower else ""))
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", help="JSON results")
  parser.add_argument("--dump", help="XLA dump folder (proof of capture)")
  parser.add_argument("--calls", type=int, default=24)
  parser.add_argument("--arms", default=",".join(ARMS))
  parser.add_argument("--plan", action="store_true",
                      help="trace every arm (no GPU needed)")
  args = parser.parse_args(argv)
  arms = [a for a in args.arms.split(",") if a]
  unknown = sorted(set(arms) - set(ARMS))
  if unknown:
    parser.error(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
  if args.calls < 1:
    parser.error(f"--calls {args.calls} must be >= 1")
  _setup_env(None if args.plan else args.dump)
  if args.plan:
    print("\n".join(plan(arms)))
    return 0
  import jax  # pylint: disable=g-import-not-at-top
  import xla_capture  # pylint: disable=g-import-not-at-top
  results = run(arms, args.calls)
  captured = xla_capture.dump_summary(args.dump, "cbcheck") if args.dump else {}
  from collective_matmul import selection  # pylint: disable=g-import-not-at-top
  meta = dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
              xla_flags=os.environ.get("XLA_FLAGS", ""),
              command_buffer_types=sorted(selection.command_buffer_types()),
              nccl=selection.loaded_nccl_version())
  print(f"meta {json.dumps(meta)}")
  for module, (inside, outside) in captured.items():
    print(f"capture {module}: {inside} kernels inside command buffers, "
          f"{outside} outside")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(meta=meta, results=results, captured=captured), f,
                indent=1)
  bad = [r["arm"] for r in results if r["status"] in ("WRONG", "MISSED")]
  print("SUMMARY", "all as expected" if not bad else f"failed: {bad}")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
