"""The plugin on MaxText's rule table: size-1 mesh axes, FSDP weights.

MaxText maps each logical name to several mesh axes, most of them of size 1
on a given mesh; those shard nothing and must not hide the pattern. Its FSDP
shards weights over `fsdp` on their embed dimension; the plugin gathers the
weight over such axes (as XLA's FSDP program does per layer) and runs the
ring over the tensor-sequence axis.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
import numpy as np
import pytest

import collective_matmul as cm
from collective_matmul import patterns
import maxtext_rules as mt
from cm_test_utils import TOLERANCE, assert_close, normal

DN3 = (((2,), (0,)), ((), ()))        # x[b, s, e] @ w[e, f]
DN_OUT = (((2, 3), (0, 1)), ((), ()))  # o[b, s, h, d] @ w[h, d, e]

# (name, lhs axes, rhs axes, out axes, dimension numbers, pattern)
PROJECTIONS = [
    ("wi_0", mt.RESIDUAL, ("embed", "mlp"), None, DN3, "all_gather"),
    ("wo", mt.MLP_HIDDEN, ("mlp", "embed"), mt.RESIDUAL, DN3,
     "reduce_scatter"),
    ("query", mt.ATTN_INPUT, ("embed_attn", "q_heads", "kv"), None, DN3,
     "all_gather"),
    ("key", mt.ATTN_INPUT, ("embed_attn", "kv_heads", "kv_head_dim"), None,
     DN3, "all_gather"),
    ("out", mt.ATTN_OUT, ("heads", "kv", "embed_attn"), mt.RESIDUAL, DN_OUT,
     "reduce_scatter"),
]


def _resolve(axes, sizes):
  with nn.logical_axis_rules(mt.LOGICAL_AXIS_RULES):
    spec = patterns.normalize_spec(nn.logical_to_mesh_axes(axes), len(axes))
  return patterns.drop_size_one_axes(spec, sizes)


def _shapes(lhs_axes, rhs_axes, dn):
  lhs = (8, 16, 32) if len(lhs_axes) == 3 else (8, 16, 4, 8)
  (lc, rc), _ = dn
  rhs = tuple(lhs[d] for d in lc) + (16,) * (len(rhs_axes) - len(rc))
  return lhs, rhs


def _match(name, sizes):
  _, lhs_axes, rhs_axes, out_axes, dn, _ = next(
      p for p in PROJECTIONS if p[0] == name)
  lhs, rhs = _shapes(lhs_axes, rhs_axes, dn)
  out = None if out_axes is None else _resolve(out_axes, sizes)
  args = (lhs, rhs, dn, _resolve(lhs_axes, sizes), _resolve(rhs_axes, sizes),
          sizes, out)
  ag = patterns.match_all_gather_matmul(*args)
  return ag if not isinstance(ag, patterns.NoMatch) else (
      patterns.match_matmul_reduce_scatter(*args))


TS4_DATA2 = dict(zip(mt.MESH_AXES, mt.mesh_shape(tensor_sequence=4, data=2)))
TS2_DATA2_FSDP2 = dict(zip(mt.MESH_AXES, mt.mesh_shape(
    tensor_sequence=2, data=2, fsdp=2)))
TENSOR4_DATA2 = dict(zip(mt.MESH_AXES, mt.mesh_shape(tensor=4, data=2)))


def test_size_one_axes_are_dropped_and_unknown_axes_kept():
  spec = (("fsdp_transpose", "tensor", "tensor_sequence"), ("fsdp",), ())
  assert patterns.drop_size_one_axes(spec, TS4_DATA2) == (
      ("tensor_sequence",), (), ())
  assert patterns.drop_size_one_axes((("nowhere",),), TS4_DATA2) == (
      ("nowhere",),)


@pytest.mark.parametrize("name,pattern", [(p[0], p[5]) for p in PROJECTIONS])
def test_every_projection_matches_on_a_tensor_sequence_mesh(name, pattern):
  match = _match(name, TS4_DATA2)
  assert not isinstance(match, patterns.NoMatch), match.reason
  kind = ("all_gather" if isinstance(match, patterns.AllGatherMatch)
          else "reduce_scatter")
  assert (kind, match.axis, match.axis_size) == (pattern, "tensor_sequence",
                                                  4)
  assert match.rhs_gathered == ()


@pytest.mark.parametrize("name,pattern", [(p[0], p[5]) for p in PROJECTIONS])
def test_fsdp_sharded_weights_are_gathered_over_fsdp(name, pattern):
  match = _match(name, TS2_DATA2_FSDP2)
  assert not isinstance(match, patterns.NoMatch), match.reason
  assert match.axis == "tensor_sequence"
  assert match.rhs_gathered == ("fsdp",)
  assert all("fsdp" not in axes for axes in match.rhs_spec)
  # The activation's batch stays sharded over data and fsdp.
  assert match.lhs_spec[0] == ("data", "fsdp")
  assert match.out_spec[0] == ("data", "fsdp")
  del pattern


def test_plain_tensor_parallelism_is_not_the_pattern():
  for name in ("wi_0", "query"):
    match = _match(name, TENSOR4_DATA2)
    assert isinstance(match, patterns.NoMatch)


def test_a_second_weight_only_axis_is_not_gathered():
  # rhs output features over ('tensor', 'tensor_sequence'): 2-D tensor
  # parallelism, not FSDP: the weight is not gathered, the rewrite declines.
  sizes = dict(zip(mt.MESH_AXES, mt.mesh_shape(tensor_sequence=2, tensor=2,
                                               data=2)))
  lhs = ((), ("tensor_sequence",), ())
  rhs = ((), ("tensor", "tensor_sequence"))
  match = patterns.match_all_gather_matmul((8, 16, 32), (32, 16), DN3, lhs,
                                           rhs, sizes)
  assert isinstance(match, patterns.NoMatch) and match.fallback
  assert "tensor" in match.reason


def _maxtext_mesh(**sizes):
  return jax.make_mesh(mt.mesh_shape(**sizes), mt.MESH_AXES,
                       axis_types=(AxisType.Auto,) * len(mt.MESH_AXES))


@pytest.mark.parametrize("mesh_sizes", [
    dict(tensor_sequence=4, data=2),
    dict(tensor_sequence=2, data=2, fsdp=2),
], ids=["ts4_data2", "ts2_data2_fsdp2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlp_forward_and_grad_match_xla_on_maxtext_meshes(mesh_sizes, dtype,
                                                          keys):
  """wi (all-gather) -> silu -> wo (reduce-scatter), with MaxText's rules and
  the weights sharded as MaxText shards them, against the same program with
  the plugin off."""
  mesh = _maxtext_mesh(**mesh_sizes)
  x = normal(keys(), (8, 16, 32), dtype)
  wi = normal(keys(), (32, 64), dtype) / 6
  wo = normal(keys(), (64, 32), dtype) / 8

  def mlp(x, wi, wo):
    dg_in = cm.logical_dot_general(mt.RESIDUAL, ("embed", "mlp"), name="wi")
    dg_out = cm.logical_dot_general(mt.MLP_HIDDEN, ("mlp", "embed"),
                                    out_axes=mt.RESIDUAL, name="wo")
    x = nn.with_logical_constraint(x, mt.RESIDUAL)
    wi = nn.with_logical_constraint(wi, ("embed", "mlp"))
    wo = nn.with_logical_constraint(wo, ("mlp", "embed"))
    h = jax.nn.silu(dg_in(x, wi, DN3))
    h = nn.with_logical_constraint(h, mt.MLP_HIDDEN)
    y = dg_out(h, wo, DN3)
    return nn.with_logical_constraint(y, mt.RESIDUAL)

  def loss(x, wi, wo):
    return jnp.sum(mlp(x, wi, wo).astype(jnp.float32) ** 2)

  results = {}
  for enabled in (False, True):  # Fresh jits: the config is read at trace.
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    with jax.set_mesh(mesh), nn.logical_axis_rules(mt.LOGICAL_AXIS_RULES):
      with cm.config_context(enabled=enabled, impl="ring"):
        results[enabled] = (jax.jit(lambda *a: mlp(*a))(x, wi, wo),
                            step(x, wi, wo))
  rewritten = [d for d in cm.decisions() if d.rewritten]
  assert {d.name: d.collective for d in rewritten} == {
      "wi": "all_gather", "wo": "reduce_scatter"}
  assert all(d.axis == "tensor_sequence" for d in rewritten)
  fsdp = mesh_sizes.get("fsdp", 1) > 1
  assert all(d.weight_gathered == (("fsdp",) if fsdp else ())
             for d in rewritten)
  tol = TOLERANCE[dtype]
  (y_off, (l_off, g_off)), (y_on, (l_on, g_on)) = results[False], results[True]
  assert_close(y_on, np.asarray(y_off, np.float64), tol)
  assert_close(l_on, np.asarray(l_off, np.float64), tol)
  for a, b in zip(g_on, g_off):
    assert_close(a, np.asarray(b, np.float64), 2 * tol)


def test_explicit_mode_gathers_an_fsdp_weight_and_drops_size_one_axes(keys):
  from jax.sharding import PartitionSpec as P
  from cm_test_utils import DN_LAST, put, reference
  mesh = jax.make_mesh((2, 4, 1), ("data", "tensor", "unused"),
                       axis_types=(AxisType.Explicit,) * 3)
  x = put(normal(keys(), (4, 16, 32), "float32"), mesh,
          P(("data", "unused"), "tensor", None))
  w = put(normal(keys(), (32, 16), "float32"), mesh, P("data", "tensor"))

  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    y = jax.jit(lambda x, w: cm.dot_general(x, w, DN_LAST(3)))(x, w)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.weight_gathered == ("data",)
  assert jax.typeof(y).sharding.spec == P("data", None, "tensor")
  assert_close(y, reference(x, w), TOLERANCE["float32"])
