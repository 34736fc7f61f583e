"""The plan owns what runs (issue 37): each implementation's config travels
in the `KernelPlan` (the ring's direction in a `RingConfig`, the kernel's
`TileConfig`), one table dispatches the forward by the plan's impl, and the
decision record names what ran."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import collective_matmul as cm
from collective_matmul import dispatch
from collective_matmul import kernels
from collective_matmul import ops
from collective_matmul import patterns
from collective_matmul import primitives
from collective_matmul import ring
from collective_matmul import selection
from collective_matmul.enums import Collective
from collective_matmul.enums import Impl
from cm_test_utils import DN_LAST
from cm_test_utils import mesh_1d
from cm_test_utils import normal

P = jax.sharding.PartitionSpec
CPU = selection.DeviceFacts("cpu", "cpu", 8)
PROBLEM = selection.Problem(512, 1024, 512, np.dtype(jnp.bfloat16), 4)


def _sends(jaxpr) -> list[str]:
  """The permutations of every `ppermute` in `jaxpr`: which way each send
  goes round the ring."""
  return sorted(re.findall(r"perm=\(\([^=]*?\)\)", str(jaxpr)))


def test_every_impl_the_ops_run_has_one_forward_per_collective():
  assert set(dispatch.IMPLEMENTATIONS) == set(ops.OP_IMPLS)
  for implementation in dispatch.IMPLEMENTATIONS.values():
    assert callable(implementation.all_gather_matmul)
    assert callable(implementation.matmul_reduce_scatter)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("requested", ["ring", "auto", "pallas"])
def test_a_ring_plan_carries_the_configured_direction(requested,
                                                      bidirectional):
  """Chosen or fallen back to (off Hopper), the ring forward and backward
  runs with `Options.bidirectional`."""
  plan = selection.choose(requested, "all_gather", PROBLEM, CPU,
                          selection.Options(bidirectional=bidirectional))
  assert (plan.impl, plan.backward_impl) == (Impl.RING, Impl.RING)
  assert plan.config == plan.backward_config == ring.RingConfig(
      bidirectional)
  assert plan.transposed().config == ring.RingConfig(bidirectional)


def test_a_baseline_plan_has_no_config():
  plan = selection.choose("baseline", "reduce_scatter", PROBLEM, CPU,
                          selection.Options(bidirectional=False))
  assert plan.config is None and plan.backward_config is None


@pytest.mark.parametrize("impl,config", [
    ("ring", kernels.AllGatherConfig()),
    ("baseline", ring.RingConfig()),
    ("pallas", ring.RingConfig()),
    ("pallas", None),
])
def test_a_plan_refuses_another_implementations_config(impl, config):
  with pytest.raises(ValueError, match=f"a {impl} plan runs"):
    selection.KernelPlan(impl, "baseline", config)


def test_a_ring_plan_without_a_config_runs_the_default_ring():
  assert selection.KernelPlan("ring", "ring").config == ring.RingConfig()


@pytest.mark.parametrize("bidirectional,label", [(True, "ring"),
                                                 (False, "ring one-way")])
def test_the_plan_describes_the_rings_direction(bidirectional, label):
  plan = selection.choose("ring", "all_gather", PROBLEM, CPU,
                          selection.Options(bidirectional=bidirectional))
  assert plan.describe() == plan.describe(backward=True) == label


def _static_params(jaxpr) -> list[primitives.Static]:
  """The `Static` of every collective matmul in `jaxpr`, nested ones too."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive is primitives.collective_matmul_p:
      found.append(eqn.params["static"])
      continue
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if hasattr(inner, "eqns"):
        found += _static_params(inner)
  return found


@pytest.mark.parametrize("bidirectional", [True, False])
def test_the_ops_put_the_rings_direction_in_the_plan(bidirectional):
  """A direct op call's `bidirectional` reaches the primitive inside the
  plan, and the ring sends the ways that direction says (D = 4)."""
  mesh = mesh_1d(4, axis_type=jax.sharding.AxisType.Auto)
  x = jax.ShapeDtypeStruct((4 * 8, 16), jnp.float32)
  w = jax.ShapeDtypeStruct((16, 4 * 8), jnp.float32)

  def body(x, w):
    return ops.all_gather_matmul(x, w, "x", impl="ring",
                                 bidirectional=bidirectional)

  def reference(x, w):
    return ring.ring_all_gather_matmul(x, w, "x",
                                       bidirectional=bidirectional)

  trace = lambda f: jax.make_jaxpr(jax.shard_map(
      f, mesh=mesh, in_specs=(P("x", None), P(None, "x")),
      out_specs=P(None, "x"), check_vma=False))(x, w)
  jaxpr = trace(body)
  [static] = _static_params(jaxpr.jaxpr)
  assert static.plan.config == ring.RingConfig(bidirectional)
  assert not hasattr(static, "bidirectional")
  assert _sends(jaxpr) == _sends(trace(reference))


def test_a_given_plan_and_a_direction_are_refused_together():
  plan = selection.KernelPlan("ring", "ring")
  with pytest.raises(TypeError, match="either plan or"):
    ops.all_gather_matmul(jnp.ones((4, 4)), jnp.ones((4, 4)), "x", plan=plan,
                          bidirectional=False)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_the_drop_in_runs_and_records_the_configured_ring(bidirectional):
  """The configuration's direction is in the recorded plan, the record says
  it where it is not the default, and the result is the plain matmul's."""
  mesh = mesh_1d(4)
  keys = jax.random.split(jax.random.key(bidirectional), 2)
  x = jax.device_put(normal(keys[0], (2, 64, 32), jnp.float32),
                     jax.sharding.NamedSharding(mesh, P(None, "x", None)))
  w = jax.device_put(normal(keys[1], (32, 64), jnp.float32),
                     jax.sharding.NamedSharding(mesh, P(None, "x")))
  cm.clear_decisions()
  with jax.set_mesh(mesh), cm.config_context(
      enabled=True, impl="ring", bidirectional=bidirectional):
    out = jax.jit(lambda x, w: cm.dot_general(x, w, DN_LAST(3)))(x, w)
  [decision] = cm.decisions()
  assert decision.rewritten
  assert decision.plan.config == ring.RingConfig(bidirectional)
  assert ("ring one-way over 'x'" in str(decision)) == (not bidirectional)
  expected = np.einsum("bsk,kn->bsn", np.asarray(x, np.float64),
                       np.asarray(w, np.float64))
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("collective", list(Collective))
def test_a_rewritten_decision_labels_what_ran_in_one_place(collective):
  plan = selection.KernelPlan("ring", "baseline")
  decision = cm.Decision(
      name="mlp/wi", rewritten=True, impl="ring", reason="", lhs_shape=(8, 4),
      rhs_shape=(4, 8), dtype="float32", axis="x", collective=collective,
      backward_impl="baseline", plan=plan)
  suffix = (" (matmul + reduce-scatter)"
            if collective == Collective.REDUCE_SCATTER else "")
  assert decision.what_runs() == f"ring over 'x'{suffix}"
  assert f"rewritten -> {decision.what_runs()}, backward baseline" in str(
      decision)
  assert decision.impl is Impl.RING and decision.collective is collective


def test_matches_carry_their_collective():
  sizes = {"x": 4}
  dn = (((1,), (0,)), ((), ()))
  gather = patterns.match_all_gather_matmul(
      (16, 8), (8, 16), dn, (("x",), ()), ((), ("x",)), sizes)
  scatter = patterns.match_matmul_reduce_scatter(
      (16, 8), (8, 16), dn, ((), ("x",)), (("x",), ()), sizes,
      (("x",), ()))
  assert gather.collective is Collective.ALL_GATHER
  assert scatter.collective is Collective.REDUCE_SCATTER


@pytest.mark.parametrize("matcher", ["all_gather", "reduce_scatter"])
def test_both_matchers_open_with_the_same_refusals(matcher):
  """Batch dimensions, an axis not in the mesh and an indivisible dimension
  are refused alike by both patterns."""
  match = {"all_gather": patterns.match_all_gather_matmul,
           "reduce_scatter": patterns.match_matmul_reduce_scatter}[matcher]
  gather = matcher == "all_gather"
  lhs_spec = (("x",), ()) if gather else ((), ("x",))
  rhs_spec = ((), ("x",)) if gather else (("x",), ())
  out = (("x",), ())
  batched = match((16, 8), (16, 8), (((1,), (1,)), ((0,), (0,))), lhs_spec,
                  rhs_spec, {"x": 4}, out)
  assert batched.reason == "dot_general has batch dimensions (0,)/(0,)"
  unknown = match((16, 8), (8, 16), (((1,), (0,)), ((), ())), lhs_spec,
                  ((), ("y",)) if gather else (("y",), ()), {"x": 4}, out)
  assert unknown.fallback and "mesh axis 'y'" in unknown.reason
  indivisible = match((18, 8) if gather else (16, 6), (8, 16) if gather
                      else (6, 16), (((1,), (0,)), ((), ())), lhs_spec,
                      rhs_spec, {"x": 4}, None if gather else out)
  assert indivisible.fallback and "not divisible by its 4 shards" in (
      indivisible.reason)
