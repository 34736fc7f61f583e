"""Einsum ops for Auto-sharded models: cm.logical_einsum (Flax logical
names), cm.mesh_axes_einsum (Praxis split-dims mappings), the legacy
`with mesh:` context (Paxml), and a Praxis-shaped layer calling them as
praxis.layers.linears.Linear does."""
import functools
from typing import Any, Callable

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from cm_test_utils import DN_LAST, TOLERANCE, assert_close, mesh_2d
from cm_test_utils import normal, put, reference

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*context manager has been deprecated:DeprecationWarning")

RULES = [("batch", "data"), ("seq", "tensor"), ("embed", None),
         ("mlp", "tensor")]


def _f64(a):
  return np.asarray(a, np.float64)


def _auto_inputs(keys, dtype="float32", shape=(2, 4)):
  mesh = mesh_2d(shape, AxisType.Auto)
  data, tensor = shape
  x = put(normal(keys(), (data * 2, tensor * 4, 32), dtype), mesh,
          P("data", "tensor", None))
  w = put(normal(keys(), (32, tensor * 8), dtype), mesh, P(None, "tensor"))
  return mesh, x, w


# ----------------------------------------------------------- logical_einsum


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logical_einsum_is_rewritten(dtype, impl, keys):
  mesh, x, w = _auto_inputs(keys, dtype)
  op = cm.logical_einsum(("batch", "seq", "embed"), ("embed", "mlp"),
                         name="mlp/wi")
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    with cm.config_context(enabled=True, impl=impl):
      y = jax.jit(lambda x, w: op("bsd,df->bsf", x, w))(x, w)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.impl == impl
  assert decision.mode == "logical" and decision.axis == "tensor"
  assert decision.name == "mlp/wi"
  assert y.dtype == jnp.dtype(dtype)
  assert_close(y, reference(x, w), TOLERANCE[dtype])


def test_logical_einsum_output_projection_reduce_scatters(keys):
  """out_axes name the result in the equation's order (here transposed)."""
  mesh = mesh_2d((2, 4), AxisType.Auto)
  h = put(normal(keys(), (4, 8, 32), "float32"), mesh,
          P("data", None, "tensor"))
  w = put(normal(keys(), (32, 16), "float32"), mesh, P("tensor", None))
  op = cm.logical_einsum(("batch", None, "mlp"), ("mlp", "embed"),
                         out_axes=("seq", "batch", "embed"), name="mlp/wo")
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    with cm.config_context(enabled=True, impl="ring"):
      f = jax.jit(lambda h, w: op("bsf,fd->sbd", h, w))
      y, text = f(h, w), f.lower(h, w).compile().as_text()
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.collective == "reduce_scatter"
  assert "all-reduce" not in text and "reduce-scatter" not in text
  assert_close(y, np.einsum("bsf,fd->sbd", _f64(h), _f64(w)),
               TOLERANCE["float32"])


def test_logical_einsum_without_out_axes_leaves_sharded_contraction(keys):
  mesh = mesh_2d((2, 4), AxisType.Auto)
  h = put(normal(keys(), (4, 8, 32), "float32"), mesh,
          P("data", None, "tensor"))
  w = put(normal(keys(), (32, 16), "float32"), mesh, P("tensor", None))
  op = cm.logical_einsum(("batch", None, "mlp"), ("mlp", "embed"))
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    with cm.config_context(enabled=True, impl="ring"):
      y = jax.jit(lambda h, w: op("bsf,fd->bsd", h, w))(h, w)
  (decision,) = cm.decisions()
  assert not decision.rewritten and "not known" in decision.reason
  assert_close(y, reference(h, w), TOLERANCE["float32"])


def test_logical_einsum_as_nnx_einsum_op(keys):
  mesh, x, _ = _auto_inputs(keys)
  seed = int(jax.random.randint(keys(), (), 0, 2**30))
  op = cm.logical_einsum(("batch", "seq", "embed"), ("embed", "mlp"))
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    layer = nnx.Einsum("bsd,df->bsf", (32, 32), (32,), einsum_op=op,
                       rngs=nnx.Rngs(seed))
    plain = nnx.Einsum("bsd,df->bsf", (32, 32), (32,), rngs=nnx.Rngs(seed))
    layer.kernel = nnx.Param(put(layer.kernel[...], mesh, P(None, "tensor")))
    loss = lambda layer, x: jnp.sum(jnp.tanh(layer(x)))
    with cm.config_context(enabled=True, impl="ring"):
      y = nnx.jit(lambda layer, x: layer(x))(layer, x)
      grads = nnx.jit(nnx.grad(loss))(layer, x)
    grads_plain = nnx.jit(nnx.grad(loss))(plain, x)
  assert [d.rewritten for d in cm.decisions()] == [True, True]
  kernel, bias = _f64(layer.kernel[...]), _f64(layer.bias[...])
  assert_close(y, _f64(x) @ kernel + bias, TOLERANCE["float32"])
  for attr in ("kernel", "bias"):
    assert_close(getattr(grads, attr)[...],
                 _f64(getattr(grads_plain, attr)[...]), 1e-5)


def test_logical_einsum_rejects_axes_that_are_not_names():
  with pytest.raises(ValueError, match="'batch'"):
    cm.logical_einsum("batch", ("embed", "mlp"))
  with pytest.raises(ValueError, match="3 is not a logical axis name"):
    cm.logical_einsum(("batch", 3), ("embed", "mlp"))


# --------------------------------------------------------- mesh_axes_einsum


@pytest.mark.parametrize("lhs_axes", [
    (("data",), "tensor", None),      # praxis style: a tuple per dimension
    P("data", "tensor", None),        # a PartitionSpec is a sequence too
], ids=["split_dims", "partition_spec"])
def test_mesh_axes_einsum_is_rewritten(lhs_axes, keys):
  mesh, x, w = _auto_inputs(keys)
  op = cm.mesh_axes_einsum(lhs_axes, (None, "tensor"), name="ffn1")
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    y = jax.jit(lambda x, w: op("...y,yz->...z", x, w))(x, w)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.axis == "tensor"
  assert decision.name == "ffn1"
  assert_close(y, reference(x, w), TOLERANCE["float32"])


def test_mesh_axes_einsum_batch_over_two_mesh_axes(keys):
  mesh = mesh_2d((2, 4), AxisType.Auto)
  x = put(normal(keys(), (16, 4, 32), "float32"), mesh,
          P(("data", "tensor"), None, None))
  w = put(normal(keys(), (32, 32), "float32"), mesh, P(None, "tensor"))
  op = cm.mesh_axes_einsum((("data", "tensor"), None, None), (None, "tensor"))
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    y = jax.jit(lambda x, w: op("bsd,df->bsf", x, w))(x, w)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.axis == "tensor"
  assert_close(y, reference(x, w), TOLERANCE["float32"])


def test_mesh_axes_einsum_keeps_the_callers_logical_rules(keys):
  """Its own resolution does not leak into the caller's rules."""
  mesh, x, w = _auto_inputs(keys)
  op = cm.mesh_axes_einsum(("data", "tensor", None), (None, "tensor"))
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    with cm.config_context(enabled=True, impl="ring"):
      jax.jit(lambda x, w: op("bsd,df->bsf", x, w))(x, w)
    assert tuple(nn.get_logical_axis_rules()) == tuple(RULES)
  assert cm.decisions()[0].rewritten


def test_mesh_axes_einsum_axis_not_in_mesh_falls_back(keys):
  mesh, x, w = _auto_inputs(keys)
  op = cm.mesh_axes_einsum(("data", "mdl", None), (None, "mdl"))
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl="ring"):
      y = jax.jit(lambda x, w: op("bsd,df->bsf", x, w))(x, w)
    with cm.config_context(enabled=True, impl="ring", strict=True):
      with pytest.raises(ValueError, match="'mdl'"):
        jax.jit(lambda x, w: op("bsd,df->bsf", x, w))(x, w)
  decision = cm.decisions()[0]
  assert not decision.rewritten and "'mdl'" in decision.reason
  assert "not in the mesh" in decision.reason
  assert_close(y, reference(x, w), TOLERANCE["float32"])


@pytest.mark.parametrize("spec,message", [
    (("tensor", "tensor", None), "mesh axis 'tensor' shards dimensions 0 and 1"),
    ((("data", "tensor"), "tensor"), "mesh axis 'tensor' shards dimensions"),
    (("data", 3, None), "entry 3 of dimension 1"),
    ("data", "'data' must be a sequence"),
])
def test_mesh_axes_einsum_rejects_invalid_split_dims(spec, message):
  with pytest.raises(ValueError, match=message):
    cm.mesh_axes_einsum(spec, (None, "tensor"))


def test_bound_einsum_is_hashable_and_comparable():
  make = lambda: cm.mesh_axes_einsum(("data", "tensor"), (None, "tensor"))
  assert make() == make() and hash(make()) == hash(make())


# --------------------------------------------------- legacy `with mesh:`


def test_legacy_mesh_context_serves_logical_dot_general(keys):
  mesh, x, w = _auto_inputs(keys)
  dot = cm.logical_dot_general(("batch", "seq", "embed"), ("embed", "mlp"))
  with mesh, nn.logical_axis_rules(RULES):
    with cm.config_context(enabled=True, impl="ring"):
      f = jax.jit(lambda x, w: dot(x, w, DN_LAST(3)))
      y, text = f(x, w), f.lower(x, w).compile().as_text()
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.axis == "tensor", decision
  assert "all-gather" not in text and "collective-permute" in text
  assert_close(y, reference(x, w), TOLERANCE["float32"])


@pytest.mark.parametrize("make_op", [
    lambda: cm.logical_einsum(("batch", "seq", "embed"), ("embed", "mlp")),
    lambda: cm.mesh_axes_einsum(("data", "tensor", None), (None, "tensor")),
], ids=["logical", "mesh_axes"])
def test_legacy_mesh_context_serves_einsum_ops(make_op, keys):
  mesh, x, w = _auto_inputs(keys)
  op = make_op()
  with mesh, nn.logical_axis_rules(RULES):
    with cm.config_context(enabled=True, impl="ring"):
      y = jax.jit(lambda x, w: op("bsd,df->bsf", x, w))(x, w)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.axis == "tensor", decision
  assert_close(y, reference(x, w), TOLERANCE["float32"])


def test_set_mesh_wins_over_the_legacy_context(keys):
  """Inside `with mesh_a:`, `jax.set_mesh(mesh_b)` is the mesh: 'tensor' of
  size 1 there shards nothing, so there is no pattern."""
  mesh, x, w = _auto_inputs(keys)
  other = jax.make_mesh((8, 1), ("data", "tensor"),
                        axis_types=(AxisType.Auto,) * 2)
  op = cm.mesh_axes_einsum(("data", "tensor", None), (None, "tensor"))
  with mesh, jax.set_mesh(other), cm.config_context(enabled=True,
                                                    impl="ring"):
    jax.jit(lambda x, w: op("bsd,df->bsf", x, w))(np.asarray(x),
                                                  np.asarray(w))
  (decision,) = cm.decisions()
  assert not decision.rewritten and "no mesh axis" in decision.reason


def test_without_any_mesh_the_einsum_op_falls_back(keys):
  x = normal(keys(), (4, 8, 32), "float32")
  w = normal(keys(), (32, 16), "float32")
  op = cm.mesh_axes_einsum(("data", "tensor", None), (None, "tensor"))
  with cm.config_context(enabled=True, impl="ring"):
    y = jax.jit(lambda x, w: op("bsd,df->bsf", x, w))(x, w)
  (decision,) = cm.decisions()
  assert not decision.rewritten and "no mesh" in decision.reason
  assert_close(y, reference(x, w), TOLERANCE["float32"])


# ------------------------------------------------------ Praxis-shaped layer
# praxis.layers.base_ops.EinsumOp, linears.Linear and a gated
# TransformerFeedForward, as far as the einsum is concerned: the layer owns
# its weight and calls its einsum child as `self.einsum('...y,yz->...z',
# inputs, w)`; the child comes from a template (`einsum_tpl`, a
# pax_fiddle.Config in Praxis, a functools.partial here).


class EinsumOp(nn.Module):
  """praxis.layers.base_ops.EinsumOp."""

  def __call__(self, equation: str, *args):
    return jnp.einsum(equation, *args)


class CollectiveEinsumOp(EinsumOp):
  """What a Paxml user sets as `einsum_tpl`: split dims at construction."""

  activation_split_dims: Any = None
  weight_split_dims: Any = None
  output_split_dims: Any = None

  def __call__(self, equation: str, *args):
    op = cm.mesh_axes_einsum(self.activation_split_dims,
                             self.weight_split_dims,
                             out_axes=self.output_split_dims,
                             name="/".join(self.scope.path))
    return op(equation, *args)


class Linear(nn.Module):
  """praxis.layers.linears.Linear."""

  input_dims: int
  output_dims: int
  einsum_tpl: Callable[[], nn.Module] = EinsumOp

  def setup(self):
    self.w = self.param("w", nn.initializers.lecun_normal(),
                        (self.input_dims, self.output_dims))
    self.einsum = self.einsum_tpl()

  def __call__(self, inputs):
    return self.einsum("...y,yz->...z", inputs, self.w)


class GatedFeedForward(nn.Module):
  """A gated FFN: layer1 and its gate share the (gathered) input."""

  dims: int
  hidden: int
  layer1_tpl: Callable[[], nn.Module] = EinsumOp
  layer2_tpl: Callable[[], nn.Module] = EinsumOp

  def setup(self):
    self.ffn_layer1 = Linear(self.dims, self.hidden, self.layer1_tpl)
    self.ffn_layer1_gate = Linear(self.dims, self.hidden, self.layer1_tpl)
    self.ffn_layer2 = Linear(self.hidden, self.dims, self.layer2_tpl)

  def __call__(self, x):
    return self.ffn_layer2(jnp.tanh(self.ffn_layer1(x)) *
                           self.ffn_layer1_gate(x))


# Sequence parallel between blocks, the hidden layer sharded on features.
ACTIVATION = (("data",), "tensor", None)
HIDDEN = (("data",), None, "tensor")
COLLECTIVE_FFN = dict(
    layer1_tpl=functools.partial(CollectiveEinsumOp,
                                 activation_split_dims=ACTIVATION,
                                 weight_split_dims=(None, "tensor")),
    layer2_tpl=functools.partial(CollectiveEinsumOp,
                                 activation_split_dims=HIDDEN,
                                 weight_split_dims=("tensor", None),
                                 output_split_dims=ACTIVATION))
DIMS, HIDDEN_DIMS = 32, 64


def _ffn_inputs(keys, dtype):
  mesh = mesh_2d((2, 4), AxisType.Auto)
  x = put(normal(keys(), (4, 16, DIMS), dtype), mesh,
          P("data", "tensor", None))
  params = {"params": {
      "ffn_layer1": {"w": normal(keys(), (DIMS, HIDDEN_DIMS), dtype)},
      "ffn_layer1_gate": {"w": normal(keys(), (DIMS, HIDDEN_DIMS), dtype)},
      "ffn_layer2": {"w": (normal(keys(), (HIDDEN_DIMS, DIMS), "float32")
                           / np.sqrt(HIDDEN_DIMS)).astype(dtype)}}}
  specs = {"ffn_layer1": P(None, "tensor"), "ffn_layer1_gate":
           P(None, "tensor"), "ffn_layer2": P("tensor", None)}
  params = {"params": {k: {"w": put(v["w"], mesh, specs[k])}
                       for k, v in params["params"].items()}}
  return mesh, x, params


def _ffn_reference(x, params, cot):
  """float64 forward and gradients (x, w1, wg, w2) of sum(ffn(x) * cot)."""
  p = {k: _f64(v["w"]) for k, v in params["params"].items()}
  x, cot = _f64(x), _f64(cot)
  a, g = x @ p["ffn_layer1"], x @ p["ffn_layer1_gate"]
  h = np.tanh(a) * g
  y = h @ p["ffn_layer2"]
  dh = cot @ p["ffn_layer2"].T
  da, dg = dh * g * (1 - np.tanh(a) ** 2), dh * np.tanh(a)
  flat = lambda t: t.reshape(-1, t.shape[-1])
  grads = {"x": da @ p["ffn_layer1"].T + dg @ p["ffn_layer1_gate"].T,
           "ffn_layer1": flat(x).T @ flat(da),
           "ffn_layer1_gate": flat(x).T @ flat(dg),
           "ffn_layer2": flat(h).T @ flat(cot)}
  return y, grads


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_praxis_shaped_gated_ffn_forward_and_grad(dtype, impl, keys):
  mesh, x, params = _ffn_inputs(keys, dtype)
  cot = put(normal(keys(), x.shape, "float32"), mesh, P("data", "tensor"))
  ffn = GatedFeedForward(DIMS, HIDDEN_DIMS, **COLLECTIVE_FFN)

  def loss(params, x):
    return jnp.sum(ffn.apply(params, x).astype(jnp.float32) * cot)

  with mesh, cm.config_context(enabled=True, impl=impl):  # as Paxml does
    y = jax.jit(ffn.apply)(params, x)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
  records = cm.decisions()
  assert all(d.rewritten and d.impl == impl for d in records), records
  served = {(d.name, d.collective) for d in records}
  assert served == {("ffn_layer1/einsum", "all_gather"),
                    ("ffn_layer1_gate/einsum", "all_gather"),
                    ("ffn_layer2/einsum", "reduce_scatter")}
  y_ref, grads_ref = _ffn_reference(x, params, cot)
  tolerance = TOLERANCE[dtype]
  assert y.dtype == jnp.dtype(dtype)
  assert_close(y, y_ref, tolerance)
  # bf16 gradients also round the cotangents and the hidden activations to
  # bf16 (up to 0.015 seen; the plain jnp.einsum layer errs as much).
  tolerance = 1e-5 if dtype == "float32" else 2 * tolerance
  assert_close(grads[1], grads_ref["x"], tolerance)
  for layer in ("ffn_layer1", "ffn_layer1_gate", "ffn_layer2"):
    assert_close(grads[0]["params"][layer]["w"], grads_ref[layer], tolerance)


def test_praxis_shaped_ffn_with_plugin_off_is_the_plain_layer(keys):
  mesh, x, params = _ffn_inputs(keys, "float32")
  plain = GatedFeedForward(DIMS, HIDDEN_DIMS)
  plugged = GatedFeedForward(DIMS, HIDDEN_DIMS, **COLLECTIVE_FFN)
  with mesh:
    with cm.config_context(enabled=False, impl="ring"):
      y = jax.jit(plugged.apply)(params, x)
    y_plain = jax.jit(plain.apply)(params, x)
    # Same parameters: the op holds none.
    init = lambda layer: jax.tree.map(np.shape, layer.init(
        jax.random.key(0), np.asarray(x)))
    assert init(plain) == init(plugged)
  assert not cm.decisions()
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_plain))
