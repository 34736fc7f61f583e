"""The configuration takes part in every trace that depends on it.

JAX caches the traces of `lax.scan`, `lax.cond`, `lax.while_loop`,
`jax.checkpoint` (and Flax's `nn.scan` / `nn.remat`) bodies by the Python
function; a body traced under one configuration must not be reused under
another. Each case lowers `grad` of a function whose body holds one
`logical_dot_general`, first under one configuration and then, freshly
jitted, under the other: "off" must equal plain `lax.dot_general`'s
program, "on" must be rewritten (collective permutes) and recorded.
"""
import functools

import flax.linen as nn
import jax
from jax import lax
from jax.sharding import AxisType
import jax.numpy as jnp
import pytest

import collective_matmul as cm
from cm_test_utils import DN_LAST
from cm_test_utils import mesh_2d

RULES = [("batch", "data"), ("seq", "tensor"), ("embed", None),
         ("mlp", "tensor")]
DOT = cm.logical_dot_general(("batch", "seq", "embed"), ("embed", "mlp"),
                             name="mlp_in")


def _layer(x, w):
  return jnp.tanh(DOT(x, w, DN_LAST(3))).sum(axis=-1, keepdims=True) * x


def _plain_layer(x, w):
  return jnp.tanh(lax.dot_general(x, w, DN_LAST(3))).sum(
      axis=-1, keepdims=True) * x


# Each wraps a layer `f(x, w) -> x'` the way a model would; built once per
# wrapper at import, so the body function object is the same in both traces
# (as in a model whose layers are defined once).
def _scan(layer):
  def body(x, w):
    return layer(x, w), None
  return lambda x, ws: lax.scan(body, x, ws)[0]


def _checkpoint(layer):
  remat = jax.checkpoint(layer)
  return lambda x, ws: remat(x, ws[0])


def _cond(layer):
  return lambda x, ws: lax.cond(x.sum() > 0, layer, lambda x, w: x, x, ws[0])


def _fori(layer):
  def body(i, x):
    return layer(x, _fori.ws[i])
  return lambda x, ws: (setattr(_fori, "ws", ws),
                        lax.fori_loop(0, ws.shape[0], body, x))[1]


def _while(layer):
  def body(carry):
    i, x, ws = carry
    return i + 1, layer(x, ws[i]), ws
  return lambda x, ws: lax.while_loop(lambda c: c[0] < c[2].shape[0], body,
                                      (0, x, ws))[1]


def _scanned_remat(layer):
  """MaxText's decoder: a remat'ed layer under scan."""
  body = jax.checkpoint(lambda x, w: (layer(x, w), None),
                        policy=jax.checkpoint_policies.nothing_saveable)
  return lambda x, ws: lax.scan(body, x, ws)[0]


class _Layer(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    w = self.param("w", nn.initializers.normal(0.1), (x.shape[-1], 16))
    return _layer(x, w), None


def _flax_scan_remat(layer):
  del layer
  model = nn.scan(nn.remat(_Layer), variable_axes={"params": 0},
                  split_rngs={"params": True}, length=2)()

  def apply(x, ws):
    params = {"params": {"w": ws}}
    return model.apply(params, x, None)[0]
  return apply


WRAPPERS = {"scan": _scan, "checkpoint": _checkpoint, "cond": _cond,
            "fori_loop": _fori, "while_loop": _while,
            "scanned_remat": _scanned_remat, "nn.scan+nn.remat":
            _flax_scan_remat}
BUILT = {name: wrap(_layer) for name, wrap in WRAPPERS.items()}
PLAIN = {name: wrap(_plain_layer) for name, wrap in WRAPPERS.items()
         if name != "nn.scan+nn.remat"}


def _program(fn, x, ws, name):
  loss = lambda x, ws: fn(x, ws).sum()
  if name == "while_loop":  # No reverse mode through a while loop.
    return jax.jit(loss).lower(x, ws).as_text()
  return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, ws).as_text()


def _inputs(mesh):
  x = jax.device_put(jnp.ones((4, 16, 16), jnp.float32) * 0.01,
                     jax.NamedSharding(mesh, jax.P("data", "tensor", None)))
  ws = jax.device_put(jnp.ones((2, 16, 16), jnp.float32) * 0.01,
                      jax.NamedSharding(mesh, jax.P(None, None, "tensor")))
  return x, ws


def _lower(name, mesh, test, **config):
  """`name`'s program and decisions under `config`, made unique to `test`
  (an exclude pattern nothing matches): a program traced under the very
  same configuration before comes from JAX's cache and records nothing."""
  x, ws = _inputs(mesh)
  cm.clear_decisions()
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    with cm.config_context(exclude=(f"no-such-layer-{test}",), **config):
      return _program(BUILT[name], x, ws, name), cm.decisions()


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_off_after_on_is_plain_dot_general(name):
  mesh = mesh_2d((2, 4), AxisType.Auto)
  on, on_decisions = _lower(name, mesh, "a", enabled=True, impl="ring")
  assert "collective_permute" in on and on_decisions
  off, off_decisions = _lower(name, mesh, "a", enabled=False)
  assert "collective_permute" not in off and not off_decisions
  if name in PLAIN:
    x, ws = _inputs(mesh)
    with jax.set_mesh(mesh):
      plain = _program(PLAIN[name], x, ws, name)
    assert off == plain


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_on_after_off_is_rewritten_and_recorded(name):
  mesh = mesh_2d((2, 4), AxisType.Auto)
  off, _ = _lower(name, mesh, "b", enabled=False)
  assert "collective_permute" not in off
  on, decisions = _lower(name, mesh, "b", enabled=True, impl="ring")
  assert "collective_permute" in on
  assert decisions and all(d.rewritten for d in decisions), decisions


def test_strict_is_consulted_after_a_lenient_trace():
  """A fallback traced leniently first must still raise under strict."""
  mesh = mesh_2d((2, 4), AxisType.Auto)
  _lower("scanned_remat", mesh, "c", enabled=True, impl="pallas")
  with pytest.raises(ValueError, match="strict"):
    _lower("scanned_remat", mesh, "c", enabled=True, impl="pallas",
           strict=True)


def test_set_config_switches_a_scanned_body_both_ways():
  mesh = mesh_2d((2, 4), AxisType.Auto)
  x, ws = _inputs(mesh)
  programs = []
  try:
    for config in (cm.CollectiveMatmulConfig(enabled=True, impl="ring",
                                             exclude=("set-config-d",)),
                   None,
                   cm.CollectiveMatmulConfig(enabled=True, impl="ring",
                                             exclude=("set-config-d",))):
      cm.set_config(config)
      with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        programs.append(_program(BUILT["scanned_remat"], x, ws, "scan"))
  finally:
    cm.set_config(None)
  assert ["collective_permute" in p for p in programs] == [True, False, True]
