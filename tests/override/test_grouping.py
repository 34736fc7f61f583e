"""Sibling projections of one activation in one collective matmul
(cm.grouped_logical_dot_general): the same numbers and gradients as each
projection alone, one collective per group forward and backward."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
import numpy as np
import pytest

import collective_matmul as cm
from cm_test_utils import TOLERANCE, assert_close, compiled_hlo
from cm_test_utils import hlo_diff, mesh_2d, normal

RULES = (("batch", "data"), ("length", "tensor"), ("heads", "tensor"),
         ("kv_heads", "tensor"), ("mlp", "tensor"))
LHS_AXES = ("batch", "length", "embed")
EMBED = 32
# Kernels per case: (shape after the embed dim, logical axes, name).
CASES = {
    # Attention with grouped-query heads: k and v narrower than q.
    "qkv_gqa": [((64,), ("embed", "heads"), "query"),
                ((16,), ("embed", "kv_heads"), "key"),
                ((16,), ("embed", "kv_heads"), "value")],
    # The same with MaxText's 3-D kernels [embed, heads, head_dim].
    "qkv_3d": [((8, 8), ("embed", "heads", "kv"), "query"),
               ((4, 8), ("embed", "kv_heads", "kv"), "key"),
               ((4, 8), ("embed", "kv_heads", "kv"), "value")],
    "mlp": [((48,), ("embed", "mlp"), "wi_0"),
            ((48,), ("embed", "mlp"), "wi_1")],
}
DN = (((2,), (0,)), ((), ()))


def _mesh():
  return mesh_2d((2, 4), AxisType.Auto)


def _inputs(keys, case, dtype):
  x = normal(keys(), (4, 16, EMBED), dtype)
  kernels = [(normal(keys(), (EMBED,) + shape, "float32") / EMBED**0.5
              ).astype(dtype) for shape, _, _ in CASES[case]]
  cots = [normal(keys(), (4, 16) + shape, "float32")
          for shape, _, _ in CASES[case]]
  return x, kernels, cots


def _grouped(case):
  def projections(x, *kernels):
    members = [(w, axes, name)
               for w, (_, axes, name) in zip(kernels, CASES[case])]
    return cm.grouped_logical_dot_general(x, members, DN, lhs_axes=LHS_AXES)
  return projections


def _loss(projections, cots):
  def loss(x, *kernels):
    outs = projections(x, *kernels)
    return sum(jnp.sum(jnp.sin(out.astype(jnp.float32)) * cot)
               for out, cot in zip(outs, cots))
  return loss


def _run(f, *args, **config):
  """`jax.jit(f)(*args)` on the 2x4 mesh with the logical rules and the
  plugin's configuration `config`; also returns the decisions it made."""
  cm.clear_decisions()
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(RULES):
    with cm.config_context(**config):
      out = jax.jit(lambda *a: f(*a))(*args)
  return out, cm.decisions()


def _reference(x, kernels, cots):
  """float64 outputs and gradients (x, every kernel) of `_loss`."""
  x64 = np.asarray(x, np.float64)
  outs, dx, dws = [], 0, []
  for w, cot in zip(kernels, cots):
    w64 = np.asarray(w, np.float64)
    y = np.tensordot(x64, w64, axes=(2, 0))
    dy = np.cos(y) * np.asarray(cot, np.float64)
    outs.append(y)
    dx = dx + np.tensordot(dy, w64, axes=(tuple(range(2, dy.ndim)),
                                          tuple(range(1, w64.ndim))))
    dws.append(np.tensordot(x64, dy, axes=((0, 1), (0, 1))))
  return outs, [dx] + dws


def _count(jaxpr, primitive):
  """How often `primitive` is bound in `jaxpr` and every jaxpr inside it."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == primitive
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          count += _count(sub, primitive)
  return count


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_outputs_equal_plugin_off_and_each_alone(case, dtype, impl,
                                                         keys):
  x, kernels, _ = _inputs(keys, case, dtype)
  grouped, decisions = _run(_grouped(case), x, *kernels, enabled=True,
                            impl=impl)
  assert [d.group for d in decisions] == [
      tuple(name for _, _, name in CASES[case])] * len(kernels)
  off, _ = _run(_grouped(case), x, *kernels, enabled=False)
  alone, _ = _run(_grouped(case), x, *kernels, enabled=True, impl=impl,
                  group_siblings=False)
  ref, _ = _reference(x, kernels, [1] * len(kernels))
  for g, o, a, r in zip(grouped, off, alone, ref):
    assert g.shape == o.shape == r.shape and g.dtype == o.dtype
    assert_close(g, r, TOLERANCE[dtype])
    assert_close(g, np.asarray(o, np.float64), TOLERANCE[dtype])
    assert_close(g, np.asarray(a, np.float64), TOLERANCE[dtype])


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_gradients_equal_plugin_off_and_each_alone(case, dtype, impl,
                                                           keys):
  x, kernels, cots = _inputs(keys, case, dtype)
  grad = lambda f: jax.grad(_loss(f, cots),
                            argnums=tuple(range(1 + len(kernels))))
  grouped, decisions = _run(grad(_grouped(case)), x, *kernels, enabled=True,
                            impl=impl)
  assert all(d.rewritten and d.group for d in decisions), decisions
  off, _ = _run(grad(_grouped(case)), x, *kernels, enabled=False)
  alone, _ = _run(grad(_grouped(case)), x, *kernels, enabled=True, impl=impl,
                  group_siblings=False)
  _, ref = _reference(x, kernels, cots)
  for g, o, a, r in zip(grouped, off, alone, ref):
    assert g.shape == r.shape and g.dtype == jnp.dtype(dtype)
    assert_close(g, r, TOLERANCE[dtype])
    assert_close(g, np.asarray(o, np.float64), TOLERANCE[dtype])
    assert_close(g, np.asarray(a, np.float64), TOLERANCE[dtype])


# --------------------------------------------------------- the decisions


def test_the_record_names_each_members_group(keys):
  x, kernels, _ = _inputs(keys, "qkv_gqa", "float32")
  _, decisions = _run(_grouped("qkv_gqa"), x, *kernels, enabled=True,
                      impl="ring")
  assert [(d.name, d.rewritten, d.impl, d.axis, d.collective) for d in
          decisions] == [(n, True, "ring", "tensor", "all_gather")
                         for n in ("query", "key", "value")]
  text = cm.format_decisions(decisions)
  assert "query (4, 16, 32)x(32, 64) float32: rewritten -> ring over " \
         "'tensor', grouped with key, value" in text, text
  assert "value (4, 16, 32)x(32, 16) float32: rewritten -> ring over " \
         "'tensor', grouped with query, key" in text, text


def test_a_member_that_does_not_match_leaves_every_member_alone(keys):
  x, kernels, _ = _inputs(keys, "qkv_gqa", "float32")
  # The value kernel's features unsharded: no all-gather pattern.
  members = lambda x, q, k, v: cm.grouped_logical_dot_general(
      x, [(q, ("embed", "heads"), "query"), (k, ("embed", "kv_heads"), "key"),
          (v, ("embed", None), "value")], DN, lhs_axes=LHS_AXES)
  outs, decisions = _run(members, x, *kernels, enabled=True, impl="ring")
  assert [(d.name, d.rewritten, d.group) for d in decisions] == [
      ("query", True, ()), ("key", True, ()), ("value", False, ())]
  for d in decisions:
    assert d.group_reason.startswith("value is not rewritten (no mesh axis "
                                     "shards both"), d.group_reason
  assert "(not grouped: value is not rewritten" in str(decisions[0])
  # The value's own reason is in its group reason already: said once.
  assert str(decisions[2]).count("no mesh axis shards both") == 1, (
      str(decisions[2]))
  ref, _ = _reference(x, kernels, [1] * 3)
  for out, r in zip(outs, ref):
    assert_close(out, r, TOLERANCE["float32"])


def test_switched_off_each_member_runs_alone_and_the_record_says_so(keys):
  x, kernels, _ = _inputs(keys, "mlp", "float32")
  _, decisions = _run(_grouped("mlp"), x, *kernels, enabled=True,
                      impl="ring", group_siblings=False)
  assert [(d.rewritten, d.group) for d in decisions] == [(True, ())] * 2
  assert all("switched off" in d.group_reason for d in decisions)


def test_the_group_siblings_flag_sets_the_config():
  from absl import flags  # pylint: disable=g-import-not-at-top
  assert cm.CollectiveMatmulConfig().group_siblings
  flags.FLAGS.unparse_flags()
  try:
    flags.FLAGS(["prog", "--use_collective_matmul"])
    assert cm.config_from_flags().group_siblings
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["prog", "--use_collective_matmul",
                 "--nocollective_matmul_group_siblings"])
    assert not cm.config_from_flags().group_siblings
  finally:
    flags.FLAGS.unparse_flags()


# ------------------------------------------------------ compiled programs


def _programs(case, keys, **config):
  x, kernels, cots = _inputs(keys, case, "float32")
  grad = jax.grad(_loss(_grouped(case), cots),
                  argnums=tuple(range(1 + len(kernels))))
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(RULES):
    with cm.config_context(**config):
      jaxpr = jax.make_jaxpr(grad)(x, *kernels)
    hlo = compiled_hlo(_mesh(), lambda *a: grad(*a), x, *kernels, **config)
  return jaxpr.jaxpr, hlo


@pytest.mark.parametrize("case", ["qkv_gqa", "mlp"])
def test_the_gradient_runs_one_collective_per_group_each_way(case, keys):
  members = len(CASES[case])
  grouped, grouped_hlo = _programs(case, keys, enabled=True, impl="baseline")
  alone, alone_hlo = _programs(case, keys, enabled=True, impl="baseline",
                               group_siblings=False)
  # Forward: one all-gather of the activation (the backward reuses it);
  # backward: dx in one matmul-reduce-scatter over the concatenated
  # contraction.
  assert (_count(grouped, "all_gather"), _count(grouped, "reduce_scatter")
          ) == (1, 1)
  # Positive control: alone, one of each per member.
  assert (_count(alone, "all_gather"), _count(alone, "reduce_scatter")) == (
      members, members)
  reduce_scatters = lambda hlo: len(re.findall(r" reduce-scatter\(", hlo))
  assert reduce_scatters(grouped_hlo) == 1
  assert reduce_scatters(alone_hlo) == members


@pytest.mark.parametrize("case", ["qkv_gqa", "mlp"])
def test_the_ring_gradient_sends_once_per_group(case, keys):
  members = len(CASES[case])
  grouped, _ = _programs(case, keys, enabled=True, impl="ring")
  alone, _ = _programs(case, keys, enabled=True, impl="ring",
                       group_siblings=False)
  assert _count(grouped, "ppermute") > 0
  assert _count(alone, "ppermute") == members * _count(grouped, "ppermute")


def test_plugin_off_compiles_to_the_plain_dot_generals(keys):
  """Off, nothing is concatenated: each member is its own lax.dot_general."""
  x, kernels, _ = _inputs(keys, "qkv_gqa", "bfloat16")
  plain = lambda x, *ws: [lax.dot_general(x, w, DN) for w in ws]
  with nn.logical_axis_rules(RULES):
    off = compiled_hlo(_mesh(), _grouped("qkv_gqa"), x, *kernels,
                       enabled=False)
    reference = compiled_hlo(_mesh(), plain, x, *kernels)
  assert not cm.decisions()
  diff = hlo_diff(reference, off, ("lax.dot_general", "grouped (off)"))
  assert not diff, diff
