"""Every JAX transformation through the collective matmuls (issue 33 item 3):
forward mode (`jvp`, `jvp` of `jit`, `linearize`, `jacfwd`), reverse
(`jacrev`), both (`hessian`, `jacfwd` of `jacfwd`), `vmap` of `grad` with
either operand mapped or both, and `grad` of `checkpoint`, each equal to
the same function written with XLA's collectives (plain `lax`), for both ops
and the portable impls; and the backward keeps its structure (the other
collective, the gathered operand used once)."""

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from collective_matmul import primitives
from collective_matmul import selection
from collective_matmul.enums import Collective
from cm_test_utils import mesh_1d, normal, put

D = 4
DN = (((1,), (0,)), ((), ()))


def _op(collective, impl, save_gathered=True):
  """The op inside shard_map over 'x' (a 1-D mesh of D), as a function of
  the global x and w; `impl=None`: plain lax, the reference."""
  if collective == "all_gather":
    specs = (P("x", None), P(None, "x")), P(None, "x")

    def body(x, w):
      if impl is None:
        return lax.dot_general(lax.all_gather(x, "x", axis=0, tiled=True),
                               w, DN)
      return cm.all_gather_matmul(x, w, "x", impl=impl,
                                  save_gathered=save_gathered)
  else:
    specs = (P(None, "x"), P("x", None)), P("x", None)

    def body(x, w):
      if impl is None:
        return lax.psum_scatter(lax.dot_general(x, w, DN), "x",
                                scatter_dimension=0, tiled=True)
      return cm.matmul_reduce_scatter(x, w, "x", impl=impl,
                                      save_gathered=save_gathered)
  return jax.shard_map(body, in_specs=specs[0], out_specs=specs[1])


def _loss(collective, impl, save_gathered=True):
  def loss(x, w):
    return jnp.sum(jnp.sin(_op(collective, impl, save_gathered)(x, w)))
  return loss


TRANSFORMS = {
    "jvp": lambda f, x, w: jax.jvp(f, (x, w), (jnp.cos(x), jnp.sin(w))),
    "jvp_of_jit": lambda f, x, w: jax.jvp(jax.jit(f), (x, w),
                                          (jnp.cos(x), jnp.sin(w))),
    "jvp_x_only": lambda f, x, w: jax.jvp(lambda x: f(x, w), (x,),
                                          (jnp.cos(x),)),
    "jvp_w_only": lambda f, x, w: jax.jvp(lambda w: f(x, w), (w,),
                                          (jnp.sin(w),)),
    "linearize": lambda f, x, w: jax.linearize(f, x, w)[1](jnp.cos(x), w),
    "jacfwd": lambda f, x, w: jax.jacfwd(f, (0, 1))(x, w),
    "jacrev": lambda f, x, w: jax.jacrev(f, (0, 1))(x, w),
    "hessian": lambda f, x, w: jax.hessian(f, (0, 1))(x, w),
    "jacfwd_jacfwd": lambda f, x, w: jax.jacfwd(jax.jacfwd(f))(x, w),
    "vmap_grad_x": lambda f, x, w: jax.vmap(jax.grad(f, (0, 1)), (0, None))(
        jnp.stack([x, 2 * x, -x]), w),
    "vmap_grad_w": lambda f, x, w: jax.vmap(jax.grad(f, (0, 1)), (None, 2))(
        x, jnp.stack([w, -w], axis=2)),
    "vmap_grad_both": lambda f, x, w: jax.vmap(jax.grad(f, (0, 1)), (1, 0))(
        jnp.stack([x, 2 * x], axis=1), jnp.stack([w, -w])),
    "grad_checkpoint": lambda f, x, w: jax.jit(jax.grad(jax.checkpoint(f),
                                                        (0, 1)))(x, w),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_transformation_equals_plain_lax(collective, impl, transform, keys):
  mesh = mesh_1d(D, axis_type=jax.sharding.AxisType.Auto)
  x = normal(keys(), (16, 8), "float32")
  w = normal(keys(), (8, 16), "float32")
  run = TRANSFORMS[transform]
  with jax.set_mesh(mesh):
    got = run(_loss(collective, impl), x, w)
    want = run(_loss(collective, None), x, w)
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got) == len(want)
  for g, r in zip(got, want):
    assert g.shape == r.shape
    # The loss sums 256 sines (and its derivatives as many terms of up to
    # a few units) in another order: f32 roundings of about 256 x eps x 3
    # = 1e-4 where the terms cancel to a small value (2.7e-5 seen on the
    # all-gather ring's jvp on JAX 0.12).
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5,
                               atol=1e-4)


def _eqns(jaxpr):
  """Every equation of `jaxpr` and the jaxprs inside it, but not inside a
  collective matmul's own forward."""
  for eqn in jaxpr.eqns:
    yield eqn
    if eqn.primitive is primitives.collective_matmul_p:
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _eqns(sub)


def _structure(collective, save_gathered):
  """grad's program: [(collective, return_gathered)] of its collective
  matmuls, and its all-gathers outside them."""
  mesh = mesh_1d(D, axis_type=jax.sharding.AxisType.Auto)
  x, w = jnp.ones((16, 8)), jnp.ones((8, 16))
  with jax.set_mesh(mesh):
    jaxpr = jax.make_jaxpr(jax.grad(_loss(collective, "ring", save_gathered),
                                    (0, 1)))(x, w)
  eqns = list(_eqns(jaxpr.jaxpr))
  matmuls = [(e.params["static"].collective.value,
              e.params["return_gathered"]) for e in eqns
             if e.primitive is primitives.collective_matmul_p]
  gathers = sum(e.primitive.name == "all_gather" for e in eqns)
  return matmuls, gathers


@pytest.mark.parametrize("save_gathered", [True, False])
def test_all_gather_backward_reduce_scatters_and_reuses_the_gathered(
    save_gathered):
  """dx through the reduce-scatter matmul; dw from the activation the
  forward gathered (save_gathered) or from one all-gather in the
  backward."""
  matmuls, gathers = _structure("all_gather", save_gathered)
  assert matmuls == [("all_gather", save_gathered),
                     ("reduce_scatter", False)]
  assert gathers == (0 if save_gathered else 1)


@pytest.mark.parametrize("save_gathered", [True, False])
def test_reduce_scatter_backward_gathers_the_cotangent_once(save_gathered):
  """dx through the all-gather matmul, whose gathered cotangent serves dw
  too (save_gathered), or dw gathers the cotangent itself."""
  matmuls, gathers = _structure("reduce_scatter", save_gathered)
  assert matmuls == [("reduce_scatter", False),
                     ("all_gather", save_gathered)]
  assert gathers == (0 if save_gathered else 1)


def test_backward_runs_the_plans_backward():
  """The transposed collective matmul carries the plan's backward, and its
  own backward is the forward's (second order)."""
  plan = selection.KernelPlan("ring", "baseline")
  static = primitives.Static(Collective.ALL_GATHER, "x", 0, plan, None, None,
                             True)
  back = static.transposed(jnp.bfloat16)
  assert back.collective == Collective.REDUCE_SCATTER
  assert (back.plan.impl, back.plan.backward_impl) == ("baseline", "ring")
  assert back.preferred_element_type == jnp.bfloat16
  assert back.transposed(None).plan == plan


@pytest.mark.parametrize("mode", ["jvp", "jacfwd", "linearize"])
def test_forward_mode_through_the_drop_in_dot_general(mode):
  """The rewritten `dot_general` under forward mode: rewritten, recorded,
  and equal to the plugin-off program (this raised "can't apply
  forward-mode autodiff (jvp) to a custom_vjp function" before)."""
  mesh = mesh_1d(4)
  rng = np.random.default_rng(0)
  x = put(rng.normal(size=(16, 8)).astype(np.float32), mesh, P("x", None))
  w = put(rng.normal(size=(8, 16)).astype(np.float32), mesh, P(None, "x"))
  f = lambda x: jnp.sin(cm.dot_general(x, w, DN,
                                       out_sharding=P(None, "x"))).sum()
  run = {"jvp": lambda x: jax.jvp(f, (x,), (jnp.cos(x),))[1],
         "jacfwd": jax.jacfwd(f),
         "linearize": lambda x: jax.linearize(f, x)[1](jnp.cos(x))}[mode]
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl="ring"):
      got = jax.jit(run)(x)
    (decision,) = cm.decisions()
    with cm.config_context(enabled=False):
      want = jax.jit(run)(x)
  assert decision.rewritten, decision
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5,
                             atol=2e-5)


POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "names": jax.checkpoint_policies.save_only_these_names("h"),
}


def _mlp(impl):
  """all-gather matmul, gelu, reduce-scatter matmul; the hidden activation
  named "h" (as MaxText names its projections for remat policies)."""
  def layer(x, wi, wo):
    h = cm.all_gather_matmul(x, wi, "x", impl=impl)
    h = checkpoint_name(h, "h")
    return cm.matmul_reduce_scatter(jax.nn.gelu(h), wo, "x", impl=impl)
  return jax.shard_map(layer, in_specs=(P("x", None), P(None, "x"),
                                        P("x", None)), out_specs=P("x", None))


def _reference_mlp(x, wi, wo):
  """_mlp in plain lax."""
  h = _op("all_gather", None)(x, wi)
  return _op("reduce_scatter", None)(jax.nn.gelu(h), wo)


def _count(jaxpr, name):
  return sum(e.primitive.name == name for e in _all_eqns(jaxpr))


def _all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _all_eqns(sub)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_remat_policies_judge_the_forward_s_own_operations(policy, keys):
  """Under `jax.checkpoint` the policy sees the rings' dots and sends, as it
  would the same code inline (as it did when the ops were `custom_vjp`
  functions): `dots_saveable` recomputes the communication in the
  backward, not the dots. Gradients equal plain lax's."""
  mesh = mesh_1d(D, axis_type=jax.sharding.AxisType.Auto)
  x = normal(keys(), (16, 8), "float32")
  wi = normal(keys(), (8, 32), "float32")
  wo = normal(keys(), (32, 8), "float32")

  def grad(impl, remat):
    loss = lambda *a: jnp.sum(jnp.sin(_mlp(impl)(*a)))
    if remat:
      loss = jax.checkpoint(loss, policy=POLICIES[policy])
    return jax.grad(loss, (0, 1, 2))

  with jax.set_mesh(mesh):
    plain = jax.make_jaxpr(grad("ring", False))(x, wi, wo).jaxpr
    remat = jax.make_jaxpr(grad("ring", True))(x, wi, wo).jaxpr
    got = grad("ring", True)(x, wi, wo)
    want = jax.grad(lambda *a: jnp.sum(jnp.sin(_reference_mlp(*a))),
                    (0, 1, 2))(x, wi, wo)
  for g, r in zip(got, want):  # (Two rings in a row: sums in other orders.)
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4,
                               atol=1e-4)
  extra_dots = _count(remat, "dot_general") - _count(plain, "dot_general")
  extra_sends = _count(remat, "ppermute") - _count(plain, "ppermute")
  # Both rings' D - 1 sends are recomputed (the all-gather's gathered
  # activation is dw's operand; the reduce-scatter's product is sin's);
  # their D dots each only where the policy does not save them: "h" saves
  # the all-gather's product, so only the reduce-scatter's are recomputed.
  assert extra_sends == 2 * (D - 1), extra_sends
  assert extra_dots == {"nothing": 2 * D, "dots": 0, "names": D}[policy], (
      extra_dots)
