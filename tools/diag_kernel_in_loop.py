"""Diagnosis: the Pallas collective kernels against the portable ring in the
situations a training step creates (MaxText's llama2 shapes, sequence
gathered, back-to-back calls, sibling projections, a training loop without
host syncs). Prints one line per case: max relative error vs ring."""
import functools
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

import collective_matmul as cm

cm.prepare_xla_for_kernels()  # Before JAX starts its GPU backend.

D = jax.device_count()
mesh = jax.make_mesh((D,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
B, S, E, F, H = 4, 4096, 4096, 11008, 4096  # global: llama2-7b dims
bf16 = jnp.bfloat16


def put(a, spec):
  return jax.device_put(a, NamedSharding(mesh, spec))


def err(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  if not np.isfinite(a).all():
    return float("nan")
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def ag(impl, x, w, **kw):
  return jax.shard_map(
      lambda x, w: cm.all_gather_matmul(x, w, "x", gather_axis=1, impl=impl,
                                        **kw),
      mesh=mesh, in_specs=(P(None, "x", None), P(None, "x")),
      out_specs=P(None, None, "x"), check_vma=False)(x, w)


def rs(impl, h, w, **kw):
  return jax.shard_map(
      lambda h, w: cm.matmul_reduce_scatter(h, w, "x", scatter_axis=1,
                                            impl=impl, **kw),
      mesh=mesh, in_specs=(P(None, None, "x"), P("x", None)),
      out_specs=P(None, "x", None), check_vma=False)(h, w)


key = jax.random.key(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
ks = jax.random.split(key, 8)
x = put(jax.random.normal(ks[0], (B, S, E), bf16), P(None, "x", None))
wi = put((jax.random.normal(ks[1], (E, F)) / 64).astype(bf16), P(None, "x"))
wq = put((jax.random.normal(ks[2], (E, H)) / 64).astype(bf16), P(None, "x"))
wo = put((jax.random.normal(ks[3], (F, E)) / 100).astype(bf16), P("x", None))
results = []


def case(name, fn):
  t = time.time()
  try:
    value = fn()
  except Exception as e:  # Diagnosis: report and go on.
    value = f"ERROR {type(e).__name__}: {str(e)[:300]}"
  line = f"{name:58s} {value}  ({time.time() - t:.1f}s)"
  print(line, flush=True)
  results.append(line)


for n_name, w in (("n=5504 (wi)", wi), ("n=2048 (q)", wq)):
  ring_f = jax.jit(functools.partial(ag, "ring"))
  pal_f = jax.jit(functools.partial(ag, "pallas"))
  ref = ring_f(x, w)
  case(f"AG single call {n_name}", lambda: err(pal_f(x, w), ref))
  # Back-to-back calls, no host sync in between, different inputs.
  def back_to_back():
    outs = [pal_f(x * (1 + i / 8), w) for i in range(8)]
    refs = [ring_f(x * (1 + i / 8), w) for i in range(8)]
    return max(err(o, r) for o, r in zip(outs, refs))
  case(f"AG 8 back-to-back calls {n_name}", back_to_back)

# Siblings in one program: q, k, v on the same activation.
def siblings(impl):
  return jax.jit(lambda x, a, b, c: (ag(impl, x, a), ag(impl, x, b),
                                     ag(impl, x, c)))
sib_ref = siblings("ring")(x, wq, wq * 2, wq * 3)
case("AG q,k,v siblings in one jit", lambda: max(
    err(a, b) for a, b in zip(siblings("pallas")(x, wq, wq * 2, wq * 3),
                              sib_ref)))

# In a scan (MaxText scans its layers).
def scanned(impl):
  def body(carry, w):
    return carry, ag(impl, carry, w)
  return jax.jit(lambda x, ws: jax.lax.scan(body, x, ws)[1])
ws = jnp.stack([wq, wq * 2, wq * 3])
case("AG in lax.scan over 3 weights", lambda: err(
    scanned("pallas")(x, ws), scanned("ring")(x, ws)))

# RS alone.
h = put((jax.random.normal(ks[4], (B, S, F))).astype(bf16), P(None, None, "x"))
case("RS single call n=4096 k=5504", lambda: err(
    jax.jit(functools.partial(rs, "pallas"))(h, wo),
    jax.jit(functools.partial(rs, "ring"))(h, wo)))


# A training loop: MLP wi0/wi1 (AG) -> silu*mul -> wo (RS); SGD without host
# syncs, 6 steps; params compared to the ring loop's.
def mlp_loss(impl, params, x):
  wi0, wi1, wo = params
  a = ag(impl, x, wi0, save_gathered=True)
  b = ag(impl, x, wi1, save_gathered=True)
  y = rs(impl, (jax.nn.silu(a.astype(jnp.float32)) * b).astype(bf16), wo)
  return jnp.mean(jnp.square(y.astype(jnp.float32)))


def train(impl, steps, remat):
  loss_fn = functools.partial(mlp_loss, impl)
  if remat:
    loss_fn = jax.checkpoint(loss_fn)
  @jax.jit
  def step(params, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    return jax.tree.map(lambda p, g: (p - 0.5 * g).astype(p.dtype), params,
                        grads), loss
  params, losses = (wi, wi * 0.5, wo), []
  for _ in range(steps):
    params, loss = step(params, x)
    losses.append(loss)
  return params, [float(l) for l in losses]


for remat in (False, True):
  def train_case(remat=remat):
    p_pal, l_pal = train("pallas", 6, remat)
    p_ring, l_ring = train("ring", 6, remat)
    return (f"params err {max(err(a, b) for a, b in zip(p_pal, p_ring)):.3g}"
            f" losses pallas {[f'{l:.4g}' for l in l_pal]} ring "
            f"{[f'{l:.4g}' for l in l_ring]}")
  case(f"MLP SGD loop 6 steps, remat={remat}", train_case)

print("\n".join(["", "SUMMARY"] + results))
