"""cm.Fp8DirectDotGeneralOp against Flax's own fp8 program (plugin off): the
same variables, values and gradients within fp8 tolerance, and the same
scales and amax histories after a few training steps, on an Explicit mesh
and with logical axis rules; through jit, grad, checkpoint and vmap."""
import functools
import subprocess
import sys

import flax.linen as nn
from flax.linen import fp8_ops
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from cm_test_utils import mesh_2d, normal

EMBED, MLP = 32, 64
STEPS = 3
LEARNING_RATE = 0.1
FP8_STATE = fp8_ops.OVERWRITE_WITH_GRADIENT
# Gradients: within an e5m2 rounding of the cotangent, relative to the
# largest entry (a missing or doubled block is off by the data's size).
FP8_TOLERANCE = 2.0**-5
# Scales and amax histories: float arithmetic on (nearly) the same values.
FLOAT_TOLERANCE = 1e-5
RULES = (("batch", "data"), ("seq", "tensor"), ("mlp", "tensor"),
         ("embed", None))
UP_AXES = dict(lhs_axes=("batch", "seq", "embed"), rhs_axes=("embed", "mlp"))
DOWN_AXES = dict(lhs_axes=("batch", None, "mlp"), rhs_axes=("mlp", "embed"),
                 out_axes=("batch", "seq", "embed"))


class Down(nn.Module):
  """The MLP's output projection, which passes an `out_sharding` (linen's
  Dense passes none, and Explicit mode needs one where the contraction is
  sharded)."""

  features: int
  dot_general_cls: type
  out_sharding: P | None = None

  @nn.compact
  def __call__(self, h):
    kernel = self.param("kernel", nn.initializers.lecun_normal(),
                        (h.shape[-1], self.features))
    kwargs = ({} if self.out_sharding is None
              else {"out_sharding": self.out_sharding})
    return self.dot_general_cls()(h, kernel, (((h.ndim - 1,), (0,)),
                                              ((), ())), **kwargs)


class Mlp(nn.Module):
  up_cls: type
  down_cls: type
  out_sharding: P | None = None

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(MLP, use_bias=False, dot_general_cls=self.up_cls)(x)
    return Down(EMBED, self.down_cls, self.out_sharding)(nn.relu(h))


FLAX_MLP = Mlp(nn.Fp8DirectDotGeneralOp, nn.Fp8DirectDotGeneralOp)
EXPLICIT_MLP = Mlp(cm.Fp8DirectDotGeneralOp, cm.Fp8DirectDotGeneralOp,
                   P("data", "tensor", None))
LOGICAL_MLP = Mlp(
    functools.partial(cm.Fp8DirectDotGeneralOp, **UP_AXES),
    functools.partial(cm.Fp8DirectDotGeneralOp, **DOWN_AXES))
KERNEL_SPECS = {"Dense_0": {"kernel": P(None, "tensor")},
                "Down_0": {"kernel": P("tensor", None)}}
ACTIVATION_SPEC = P("data", "tensor", None)


def _loss(model, variables, x, target):
  return jnp.mean((model.apply(variables, x) - target) ** 2)


def _step(model, variables, x, target):
  """One SGD step; the fp8 state is replaced by its gradient (Flax's
  `_overwrite_with_gradient` convention)."""
  loss, grads = jax.value_and_grad(functools.partial(_loss, model))(
      variables, x, target)
  params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g,
                        variables["params"], grads["params"])
  return loss, grads, {"params": params, FP8_STATE: grads[FP8_STATE]}


def _train(model, variables, x, target):
  """Losses and parameter gradients of each step, and the last
  variables."""
  step = jax.jit(functools.partial(_step, model))
  history = []
  for _ in range(STEPS):
    loss, grads, variables = step(variables, x, target)
    history.append((loss, grads["params"]))
  return history, variables


def _placed(variables, mesh):
  """`variables` with the kernels sharded for the collective matmuls and
  the fp8 state replicated."""
  return {
      "params": jax.tree.map(
          lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)),
          variables["params"], KERNEL_SPECS),
      FP8_STATE: jax.tree.map(
          lambda a: jax.device_put(a, NamedSharding(mesh, P())),
          variables[FP8_STATE])}


def _inputs(keys):
  x = normal(keys(), (4, 16, EMBED), jnp.float32)
  return x, normal(keys(), (4, 16, EMBED), jnp.float32)


def _assert_within_fp8(actual, expected):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    np.testing.assert_allclose(a, e, rtol=0,
                               atol=FP8_TOLERANCE * np.max(np.abs(e)))


def _assert_same_training(history, variables, ref_history, ref_variables):
  for (loss, grads), (ref_loss, ref_grads) in zip(history, ref_history):
    np.testing.assert_allclose(loss, ref_loss, rtol=FP8_TOLERANCE)
    _assert_within_fp8(grads, ref_grads)
  _assert_within_fp8(variables["params"], ref_variables["params"])
  state = jax.tree.map(np.asarray, variables[FP8_STATE])
  ref_state = jax.tree.map(np.asarray, ref_variables[FP8_STATE])
  assert jax.tree.structure(state) == jax.tree.structure(ref_state)
  for leaf, ref_leaf in zip(jax.tree.leaves(state),
                            jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(leaf, ref_leaf, rtol=FLOAT_TOLERANCE)
  # The histories hold every step's amax, the scales have moved off 1.
  assert all(np.count_nonzero(h) == STEPS for h in jax.tree.leaves(
      ref_state) if h.shape == (1024,))


def _decision_lines():
  return {(d.name, d.dtype, d.collective and str(d.collective), d.rewritten)
          for d in cm.decisions()}


EXPECTED_DECISIONS = {
    ("Dense_0", "e4m3 x e4m3 -> f32", "all_gather", True),
    ("Dense_0/dgrad", "e5m2 x e4m3 -> f32", "reduce_scatter", True),
    ("Down_0", "e4m3 x e4m3 -> f32", "reduce_scatter", True),
    ("Down_0/dgrad", "e5m2 x e4m3 -> f32", "all_gather", True),
}


def test_variables_are_those_of_flax_fp8_op(keys):
  x, _ = _inputs(keys)
  key = keys()
  mesh = mesh_2d((2, 4))
  ref = jax.jit(FLAX_MLP.init)(key, x)
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    ours = jax.jit(EXPLICIT_MLP.init)(key, jax.device_put(
        x, NamedSharding(mesh, ACTIVATION_SPEC)))
  assert jax.tree.structure(ours) == jax.tree.structure(ref)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("impl", ["ring", "baseline"])
def test_explicit_mesh_training_matches_flax(impl, keys):
  x, target = _inputs(keys)
  variables = FLAX_MLP.init(keys(), x)
  # Flax's program on one device: the same math, no collectives.
  ref_history, ref_variables = _train(FLAX_MLP, variables, x, target)
  mesh = mesh_2d((2, 4))
  put = lambda a: jax.device_put(a, NamedSharding(mesh, ACTIVATION_SPEC))
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl=impl):
    history, ours = _train(EXPLICIT_MLP, _placed(variables, mesh), put(x),
                           put(target))
  assert _decision_lines() == EXPECTED_DECISIONS
  _assert_same_training(history, ours, ref_history, ref_variables)


@pytest.mark.parametrize("impl", ["ring", "baseline"])
def test_logical_axes_training_matches_flax(impl, keys):
  x, target = _inputs(keys)
  variables = FLAX_MLP.init(keys(), x)
  mesh = mesh_2d((2, 4), AxisType.Auto)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, ACTIVATION_SPEC))
  placed = _placed(variables, mesh)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    # Flax's program on the same mesh, partitioned by XLA.
    ref_history, ref_variables = _train(FLAX_MLP, placed, put(x),
                                        put(target))
    with cm.config_context(enabled=True, impl=impl):
      history, ours = _train(LOGICAL_MLP, placed, put(x), put(target))
  assert _decision_lines() == EXPECTED_DECISIONS
  _assert_same_training(history, ours, ref_history, ref_variables)


def test_checkpointed_loss_gives_the_same_gradients(keys):
  x, target = _inputs(keys)
  mesh = mesh_2d((2, 4))
  put = lambda a: jax.device_put(a, NamedSharding(mesh, ACTIVATION_SPEC))
  variables = _placed(FLAX_MLP.init(keys(), x), mesh)
  loss = functools.partial(_loss, EXPLICIT_MLP)
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    plain = jax.jit(jax.grad(loss))(variables, put(x), put(target))
    remat = jax.jit(jax.grad(jax.checkpoint(loss)))(variables, put(x),
                                                     put(target))
  for a, b in zip(jax.tree.leaves(remat), jax.tree.leaves(plain)):
    np.testing.assert_allclose(a, b, rtol=FLOAT_TOLERANCE)


def _fp8_arguments(keys):
  """Scales and amax histories as after some steps: each its own."""
  scale = lambda: jnp.exp(normal(keys(), (1,), jnp.float32))
  history = lambda: jnp.abs(4 * normal(keys(), (16,), jnp.float32))
  return dict(lhs_scale=scale(), rhs_scale=scale(), grad_scale=scale(),
              lhs_amax_history=history(), rhs_amax_history=history(),
              grad_amax_history=history())


def test_vmapped_gradients_match_flax(keys):
  # A leading vmapped dimension of the activation: values, gradients and
  # the updated fp8 state per example, as Flax's function gives them.
  mesh = mesh_2d((2, 4), AxisType.Auto)
  x = normal(keys(), (3, 8, 16, EMBED), jnp.float32)
  kernel = normal(keys(), (EMBED, MLP), jnp.float32)
  dims = (((2,), (0,)), ((), ()))
  fp8_args = _fp8_arguments(keys)

  def loss(fn, x, kernel, fp8_args):
    y = fn(x, kernel, dims, preferred_element_type=jnp.float32, **fp8_args)
    return jnp.sum(jnp.sin(y))

  def per_example(fn):
    grad = jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2))
    return jax.jit(jax.vmap(grad, in_axes=(0, None, None)))(x, kernel,
                                                            fp8_args)

  ours_fn = functools.partial(cm.fp8_scaled_dot_general,
                              lhs_axes=("batch", "seq", "embed"),
                              rhs_axes=("embed", "mlp"))
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    ref = per_example(fp8_ops.fp8_scaled_dot_general)
    with cm.config_context(enabled=True, impl="ring"):
      ours = per_example(ours_fn)
  assert {d.rewritten for d in cm.decisions()} == {True}
  _assert_within_fp8(ours[:2], ref[:2])
  for a, b in zip(jax.tree.leaves(ours[2]), jax.tree.leaves(ref[2])):
    np.testing.assert_allclose(a, b, rtol=FLOAT_TOLERANCE)


def test_forward_mode_raises_as_in_flax(keys):
  # Flax's quantized_dot is a custom_vjp, and so is this one.
  x = normal(keys(), (8, EMBED), jnp.float32)
  kernel = normal(keys(), (EMBED, MLP), jnp.float32)
  dims = (((1,), (0,)), ((), ()))
  for fn in (fp8_ops.fp8_scaled_dot_general, cm.fp8_scaled_dot_general):
    f = lambda x, fn=fn: fn(x, kernel, dims,
                            preferred_element_type=jnp.float32,
                            **_fp8_arguments(keys))
    with pytest.raises(TypeError, match="custom_vjp"):
      jax.jvp(f, (x,), (x,))


def test_import_collective_matmul_imports_no_flax():
  code = ("import sys, collective_matmul as cm\n"
          "assert 'flax' not in sys.modules\n"
          "cm.Fp8DirectDotGeneralOp\n"
          "assert 'flax' in sys.modules\n")
  subprocess.run([sys.executable, "-c", code], check=True)
