"""cm.dot_general as the dot_general of Flax linen Dense and nnx Linear."""
import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from cm_test_utils import TOLERANCE, assert_close, mesh_1d, mesh_2d
from cm_test_utils import normal, put

CASES = {
    # mesh, x shape, x spec, kernel spec, output spec
    "1d_rows": (lambda: mesh_1d(4), (16, 32), P("x", None), P(None, "x"),
                P(None, "x")),
    "2x4_batch_seq": (lambda: mesh_2d((2, 4)), (4, 8, 32),
                      P("data", "tensor", None), P(None, "tensor"),
                      P("data", None, "tensor")),
}
FEATURES = 32


@pytest.mark.parametrize("case", list(CASES))
def test_linen_dense_with_plugin_matches_plain_dense(case, keys):
  make_mesh, x_shape, x_spec, k_spec, out_spec = CASES[case]
  mesh = make_mesh()
  x = put(normal(keys(), x_shape, "float32"), mesh, x_spec)
  init_key = keys()
  plain = nn.Dense(FEATURES)
  plugged = nn.Dense(FEATURES, dot_general=cm.dot_general)
  with jax.set_mesh(mesh):
    params = plain.init(init_key, x)
    with cm.config_context(enabled=True, impl="ring"):
      params_plugged = plugged.init(init_key, x)
  # Initialization does not depend on the dot_general.
  jax.tree.map(np.testing.assert_array_equal, params, params_plugged)
  params = jax.tree.map(lambda a: a, params)
  params["params"]["kernel"] = put(
      params["params"]["kernel"] + 0.1 * normal(keys(), (x_shape[-1],
                                                         FEATURES),
                                                "float32"), mesh, k_spec)
  params["params"]["bias"] = put(normal(keys(), (FEATURES,), "float32"),
                                 mesh, P())
  cm.clear_decisions()
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    y = jax.jit(plugged.apply)(params, x)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.impl == "ring"
  assert jax.typeof(y).sharding.spec == out_spec
  # Plain Dense can't run on this layout without an out_sharding, which
  # linen doesn't pass; its reference is the same Dense on gathered inputs.
  x_full = np.asarray(x)
  with jax.set_mesh(mesh):
    y_plain = jax.jit(plain.apply)(jax.tree.map(np.asarray, params), x_full)
  assert_close(y, np.asarray(y_plain, np.float64), TOLERANCE["float32"])
  kernel = np.asarray(params["params"]["kernel"], np.float64)
  bias = np.asarray(params["params"]["bias"], np.float64)
  assert_close(y, x_full.astype(np.float64) @ kernel + bias,
               TOLERANCE["float32"])


@pytest.mark.parametrize("case", list(CASES))
def test_linen_dense_general_with_plugin_is_rewritten(case, keys):
  make_mesh, x_shape, x_spec, k_spec, out_spec = CASES[case]
  mesh = make_mesh()
  x = put(normal(keys(), x_shape, "float32"), mesh, x_spec)
  layer = nn.DenseGeneral(FEATURES, dot_general=cm.dot_general,
                          use_bias=False)
  kernel = put(normal(keys(), (x_shape[-1], FEATURES), "float32"), mesh,
               k_spec)
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="baseline"):
    y = jax.jit(layer.apply)({"params": {"kernel": kernel}}, x)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.impl == "baseline"
  assert jax.typeof(y).sharding.spec == out_spec
  assert_close(y, np.asarray(x, np.float64) @ np.asarray(kernel, np.float64),
               TOLERANCE["float32"])


def _nnx_linear(dot_general, in_features, seed):
  kwargs = {} if dot_general is None else {"dot_general": dot_general}
  return nnx.Linear(in_features, FEATURES, rngs=nnx.Rngs(seed), **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_nnx_linear_with_plugin_matches_plain_linear(case, keys):
  make_mesh, x_shape, x_spec, k_spec, out_spec = CASES[case]
  mesh = make_mesh()
  x = put(normal(keys(), x_shape, "float32"), mesh, x_spec)
  seed = int(jax.random.randint(keys(), (), 0, 2**30))
  with jax.set_mesh(mesh):
    plain = _nnx_linear(None, x_shape[-1], seed)
    plugged = _nnx_linear(cm.dot_general, x_shape[-1], seed)
    # Same parameters with or without the plugin.
    np.testing.assert_array_equal(np.asarray(plain.kernel[...]),
                                  np.asarray(plugged.kernel[...]))
    np.testing.assert_array_equal(np.asarray(plain.bias[...]),
                                  np.asarray(plugged.bias[...]))
    bias = normal(keys(), (FEATURES,), "float32")
    for layer in (plain, plugged):
      layer.kernel = nnx.Param(put(layer.kernel[...], mesh, k_spec))
      layer.bias = nnx.Param(put(bias, mesh, P()))

    @nnx.jit
    def call(layer, x):
      return layer(x, out_sharding=out_spec)

    y_plain = call(plain, x)
    assert not cm.decisions()
    with cm.config_context(enabled=True, impl="ring"):
      y = call(plugged, x)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.impl == "ring"
  assert jax.typeof(y).sharding.spec == out_spec
  assert jax.typeof(y_plain).sharding.spec == out_spec
  assert_close(y, np.asarray(y_plain, np.float64), TOLERANCE["float32"])
  kernel = np.asarray(plugged.kernel[...], np.float64)
  assert_close(y, np.asarray(x, np.float64) @ kernel + np.asarray(bias),
               TOLERANCE["float32"])


def test_nnx_linear_with_plugin_disabled_is_plain(keys):
  make_mesh, x_shape, x_spec, k_spec, out_spec = CASES["1d_rows"]
  mesh = make_mesh()
  x = put(normal(keys(), x_shape, "float32"), mesh, x_spec)
  with jax.set_mesh(mesh):
    layer = _nnx_linear(cm.dot_general, x_shape[-1], 0)
    layer.kernel = nnx.Param(put(layer.kernel[...], mesh, k_spec))
    with cm.config_context(enabled=False, impl="ring"):
      y = nnx.jit(lambda layer, x: layer(x, out_sharding=out_spec))(layer, x)
  assert not cm.decisions()
  expected = (np.asarray(x, np.float64) @ np.asarray(layer.kernel[...],
                                                      np.float64)
              + np.asarray(layer.bias[...]))
  assert_close(y, expected, TOLERANCE["float32"])


def test_nnx_linear_grads_match_plain_linear(keys):
  make_mesh, x_shape, x_spec, k_spec, out_spec = CASES["2x4_batch_seq"]
  mesh = make_mesh()
  x = put(normal(keys(), x_shape, "float32"), mesh, x_spec)
  grads = {}
  with jax.set_mesh(mesh):
    for name, dot in (("plain", None), ("plugin", cm.dot_general)):
      layer = _nnx_linear(dot, x_shape[-1], 7)
      layer.kernel = nnx.Param(put(layer.kernel[...], mesh, k_spec))
      loss = lambda layer, x: jnp.sum(jnp.tanh(
          layer(x, out_sharding=out_spec)))
      with cm.config_context(enabled=True, impl="ring"):
        grads[name] = nnx.jit(nnx.grad(loss))(layer, x)
  assert [d.rewritten for d in cm.decisions()] == [True]
  for attr in ("kernel", "bias"):
    assert_close(getattr(grads["plugin"], attr)[...],
                 np.asarray(getattr(grads["plain"], attr)[...], np.float64),
                 1e-5)
