"""Flax's logical-axis rules are not part of JAX's cache keys (issue 39,
item 5; docs/ADVANCED.md, "What is guaranteed, and what is not").

Flax keeps `nn.logical_axis_rules` in its own thread-local state, outside
JAX's trace context, so a `lax.scan` body JAX cached under one set of rules
is reused under another. These pin that limit (the body keeps the rewrite
decided under the first rules, records nothing, and computes the right
values) and the documented way to retrace: the rules in a user context.
"""
import os
import re

import flax.linen as nn
import jax
from jax import lax
from jax.sharding import AxisType
import jax.numpy as jnp
import numpy as np

import collective_matmul as cm
from cm_test_utils import DN_LAST
from cm_test_utils import mesh_2d

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TENSOR_RULES = [("batch", "data"), ("seq", "tensor"), ("embed", None),
                ("mlp", "tensor")]
NO_RULES = [("batch", None), ("seq", None), ("embed", None), ("mlp", None)]
DOT = cm.logical_dot_general(("batch", "seq", "embed"), ("embed", "mlp"),
                             name="mlp_in")
# The recipe of docs/ADVANCED.md: the rules in JAX's cache keys.
RULES_KEY = jax.make_user_context(None)


# Defined once, as a model's layer is: the same function object in every
# trace, so JAX's scan cache may serve it.
def _body(x, w):
  return jnp.tanh(DOT(x, w, DN_LAST(3))), None


def _step(x, ws):
  return lax.scan(_body, x, ws)[0]


def _inputs(mesh, rng):
  x = rng.standard_normal((4, 16, 16)).astype(np.float32)
  ws = (0.3 * rng.standard_normal((2, 16, 16))).astype(np.float32)
  return (x, ws, jax.device_put(x, jax.NamedSharding(
      mesh, jax.P("data", "tensor", None))), jax.device_put(
          ws, jax.NamedSharding(mesh, jax.P(None, None, "tensor"))))


def _reference(x, ws):
  y = x.astype(np.float64)
  for w in ws.astype(np.float64):
    y = np.tanh(y @ w)
  return y


def _run(mesh, rules, x, ws, keyed):
  """A freshly jitted step under `rules`: its program, its value and the
  decisions its trace recorded."""
  cm.clear_decisions()
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    with RULES_KEY(repr(rules)) if keyed else RULES_KEY(None):
      step = jax.jit(lambda x, ws: _step(x, ws))
      program = step.lower(x, ws).as_text()
      value = np.asarray(step(x, ws), np.float64)
  return program, value, cm.decisions()


def test_a_body_cached_under_other_rules_keeps_its_rewrite_and_records_nothing(
    rng):
  mesh = mesh_2d((2, 4), AxisType.Auto)
  x_np, ws_np, x, ws = _inputs(mesh, rng)
  with cm.config_context(enabled=True, impl="ring",
                         exclude=("no-such-layer-unkeyed",)):
    first, _, decisions = _run(mesh, TENSOR_RULES, x, ws, keyed=False)
    assert "collective_permute" in first
    assert decisions and all(d.rewritten for d in decisions), decisions
    second, value, decisions = _run(mesh, NO_RULES, x, ws, keyed=False)
  assert "collective_permute" in second  # The limit: the body was reused.
  assert not decisions
  np.testing.assert_allclose(value, _reference(x_np, ws_np), rtol=1e-4,
                             atol=1e-5)


def test_the_rules_in_a_user_context_retrace_the_body_under_new_rules(rng):
  mesh = mesh_2d((2, 4), AxisType.Auto)
  x_np, ws_np, x, ws = _inputs(mesh, rng)
  with cm.config_context(enabled=True, impl="ring",
                         exclude=("no-such-layer-keyed",)):
    first, _, decisions = _run(mesh, TENSOR_RULES, x, ws, keyed=True)
    assert "collective_permute" in first
    assert decisions and all(d.rewritten for d in decisions), decisions
    second, value, decisions = _run(mesh, NO_RULES, x, ws, keyed=True)
  assert "collective_permute" not in second
  assert decisions and not any(d.rewritten for d in decisions), decisions
  np.testing.assert_allclose(value, _reference(x_np, ws_np), rtol=1e-4,
                             atol=1e-5)


def test_the_guarantees_state_the_limit_and_the_recipe():
  with open(os.path.join(REPO_ROOT, "docs", "ADVANCED.md")) as f:
    text = f.read()
  section = re.search(r"### What is guaranteed, and what is not\n(.*?)\n### ",
                      text, re.S).group(1)
  assert "logical-axis rules" in section
  assert "rules_key(repr(rules))" in section
  assert "tests/override/test_logical_rules_in_traces.py" in section
