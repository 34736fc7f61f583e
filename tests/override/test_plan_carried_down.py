"""Decide once, carry the plan down: the configs the kernels receive are the
ones the decision record names, forward and backward, for both collectives
and for a grouped call; `selection.choose` runs once per rewritten matmul
(per group), and nothing below the public ops chooses again.

The kernel entries are faked (they record the config they get and return
zeros of the right shape), and the mesh is described as H200s, so the whole
path from `dot_general` to the kernel call is traced on CPU.
"""
import flax.linen as nn
import jax
from jax.sharding import AxisType
import jax.numpy as jnp
import pytest

import collective_matmul as cm
from collective_matmul import kernels
from collective_matmul import ops
from collective_matmul import selection
from cm_test_utils import DN_LAST
from cm_test_utils import mesh_2d

RULES = [("batch", "data"), ("seq", "tensor"), ("embed", None),
         ("mlp", "tensor")]
H200 = selection.DeviceFacts("gpu", "NVIDIA H200", 132, 1, 8)


@pytest.fixture
def faked(monkeypatch):
  """Fake kernel entries and H200 device facts; returns the log of
  (kernel, config) calls and the count of `choose` calls."""
  log, counts = [], {"choose": 0, "inside": False}
  monkeypatch.setattr(selection, "device_facts", lambda mesh=None: H200)

  def all_gather(x, w, axis_name, *, config, out_dtype=None,
                 rows_per_batch=None, return_gathered=False):
    del rows_per_batch
    log.append(("all_gather", config))
    d = jax.lax.axis_size(axis_name)
    out = jnp.zeros((d * x.shape[0], w.shape[1]), out_dtype or x.dtype)
    held = jnp.zeros((d,) + x.shape, x.dtype)
    return (out, held) if return_gathered else out

  def reduce_scatter(x, w, axis_name, *, config, out_dtype=None,
                     rows_per_batch=None):
    del rows_per_batch
    log.append(("reduce_scatter", config))
    d = jax.lax.axis_size(axis_name)
    return jnp.zeros((x.shape[0] // d, w.shape[1]), out_dtype or x.dtype)

  monkeypatch.setattr(kernels, "all_gather_lhs_matmul", all_gather)
  monkeypatch.setattr(kernels, "matmul_reduce_scatter", reduce_scatter)
  choose, config_for = selection.choose, selection.config_for

  def counted_choose(*args, **kwargs):
    counts["choose"] += 1
    counts["inside"] = True
    try:
      return choose(*args, **kwargs)
    finally:
      counts["inside"] = False

  def guarded_config_for(*args, **kwargs):
    assert counts["inside"], "a config was chosen outside choose()"
    return config_for(*args, **kwargs)

  monkeypatch.setattr(selection, "choose", counted_choose)
  monkeypatch.setattr(selection, "config_for", guarded_config_for)
  return log, counts


def _spec(mesh, shape, spec):
  return jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                              sharding=jax.NamedSharding(mesh, jax.P(*spec)))


def _mlp(grouped):
  """x [b, s, e] (s on tensor) -> wi (one, or wi_0 and wi_1 grouped) ->
  wo reduce-scattered back to s on tensor."""
  wi = cm.logical_dot_general(("batch", "seq", "embed"), ("embed", "mlp"),
                              name="wi")
  wo = cm.logical_dot_general(("batch", None, "mlp"), ("mlp", "embed"),
                              out_axes=("batch", "seq", "embed"), name="wo")

  def loss(x, w0, w1, w2):
    if grouped:
      h0, h1 = cm.grouped_logical_dot_general(
          x, [(w0, ("embed", "mlp"), "wi_0"), (w1, ("embed", "mlp"), "wi_1")],
          DN_LAST(3), lhs_axes=("batch", "seq", "embed"))
      h = h0 * h1
    else:
      h = wi(x, w0, DN_LAST(3))
    return wo(h, w2, DN_LAST(3)).astype(jnp.float32).sum()
  return loss


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_kernels_receive_the_recorded_configs(faked, grouped, impl):
  log, counts = faked
  mesh = mesh_2d((2, 4), AxisType.Auto)
  # Per shard: 4096 rows, k = 1024, n = 1024 (wi), 1024 x 1024 (wo).
  x = _spec(mesh, (2, 16384, 1024), ("data", "tensor", None))
  w = _spec(mesh, (1024, 4096), (None, "tensor"))
  w2 = _spec(mesh, (4096, 1024), ("tensor", None))
  cm.clear_decisions()
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    with cm.config_context(enabled=True, impl=impl):
      jax.jit(jax.grad(_mlp(grouped), argnums=(0, 1, 2, 3))).lower(
          x, w, w, w2)
  decisions = cm.decisions()
  plans = {d.name: d.plan for d in decisions}
  assert all(d.rewritten for d in decisions), decisions
  first = "wi_0" if grouped else "wi"
  wi, wo = plans[first], plans["wo"]
  if grouped:
    assert plans["wi_1"] == wi  # One plan for the group.
  for plan in (wi, wo):
    assert plan.impl == plan.backward_impl == "pallas", plan
  # Forward: wi's all-gather kernel, wo's reduce-scatter kernel; backward
  # (in reverse): wo's dx is an all-gather matmul, wi's a reduce-scatter.
  assert log == [("all_gather", wi.config), ("reduce_scatter", wo.config),
                 ("all_gather", wo.backward_config),
                 ("reduce_scatter", wi.backward_config)]
  assert counts["choose"] == 2  # One per rewritten matmul or group.
  for decision in decisions:
    text = str(decision)
    assert selection.config_label(decision.plan.config) in text
    assert f"({decision.plan.source})" in text
    assert "backward pallas " + selection.config_label(
        decision.plan.backward_config) in text


def test_a_direct_op_call_chooses_once_and_a_given_plan_never(faked):
  log, counts = faked
  mesh = mesh_2d((1, 8), AxisType.Auto)
  x = _spec(mesh, (8 * 4096, 1024), ("tensor", None))
  w = _spec(mesh, (1024, 8 * 1024), (None, "tensor"))

  def run(plan=None, impl=None):
    def body(x, w):
      return ops.all_gather_matmul(x, w, "tensor", impl=impl, plan=plan)
    f = jax.shard_map(body, mesh=mesh, in_specs=(jax.P("tensor"),
                                                 jax.P(None, "tensor")),
                      out_specs=jax.P(None, "tensor"), check_vma=False)
    with jax.set_mesh(mesh):
      jax.jit(jax.grad(lambda x, w: f(x, w).astype(jnp.float32).sum(),
                       argnums=(0, 1))).lower(x, w)

  run(impl="pallas")
  assert counts["choose"] == 1 and len(log) == 2
  given = log[0][1]
  plan = selection.KernelPlan(
      "pallas", "pallas", given, selection.CALLER, log[1][1],
      selection.CALLER)
  log.clear()
  run(plan=plan)
  assert counts["choose"] == 1, "ops chose again though given a plan"
  assert log == [("all_gather", plan.config),
                 ("reduce_scatter", plan.backward_config)]


def test_ops_and_kernels_hold_no_decision():
  """The source pins it too: below `selection`, only the public ops' own
  `_plan` may call `choose`, and nothing calls `config_for`."""
  import inspect
  import pathlib
  source = inspect.getsource(ops)
  assert source.count("selection.choose(") == 2  # In _plan only.
  assert "config_for(" not in source.replace("`selection.config_for`", "")
  assert "select_config" not in source
  for path in pathlib.Path(kernels.__file__).parent.glob("*.py"):
    text = path.read_text()
    for needle in ("import selection", "collective_matmul.selection import",
                   "select_config(", "config_for(", "choose("):
      assert needle not in text, (path, needle)
