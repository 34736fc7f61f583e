"""Strict mode: a fallback is a ValueError naming its reason."""
import jax
from jax import lax
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from cm_test_utils import DN_LAST, assert_close, mesh_1d, normal, put
from cm_test_utils import reference


def _operands(keys, lhs_dtype="bfloat16", rhs_dtype="bfloat16",
              w_spec=P(None, "x")):
  mesh = mesh_1d(4)
  x = put(normal(keys(), (16, 32), lhs_dtype), mesh, P("x", None))
  w = put(normal(keys(), (32, 16), rhs_dtype), mesh, w_spec)
  return mesh, x, w


def test_strict_pallas_on_cpu_raises_naming_the_backend(keys):
  mesh, x, w = _operands(keys)
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl="pallas", strict=True):
      with pytest.raises(cm.StrictFallbackError,
                         match="pallas unavailable") as info:
        jax.jit(lambda x, w: cm.dot_general(x, w, DN_LAST(2)))(x, w)
  assert "backend" in str(info.value) and "'cpu'" in str(info.value)
  assert isinstance(info.value, ValueError)  # What it raised before.
  # A refusal, not a record: what it would have done instead, not
  # "rewritten".
  assert "rewritten" not in str(info.value)
  assert "cannot be served as configured" in str(info.value)
  assert "it would run ring over 'x'" in str(info.value)


def test_non_strict_pallas_on_cpu_falls_back_to_ring(keys):
  mesh, x, w = _operands(keys)
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl="pallas", strict=False):
      y = jax.jit(lambda x, w: cm.dot_general(x, w, DN_LAST(2)))(x, w)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.impl == "ring"
  assert "backend" in decision.reason and "cpu" in decision.reason
  assert_close(y, reference(x, w), 2e-2)


def test_strict_auto_on_cpu_does_not_raise(keys):
  """`auto` chose the fallback by design: not an error even when strict."""
  mesh, x, w = _operands(keys)
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl="auto", strict=True):
      y = jax.jit(lambda x, w: cm.dot_general(x, w, DN_LAST(2)))(x, w)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.impl == "ring"
  assert_close(y, reference(x, w), 2e-2)


def test_strict_mismatched_dtypes_raise_naming_them(keys):
  mesh, x, w = _operands(keys, "float32", "bfloat16")
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl="ring", strict=True):
      with pytest.raises(ValueError) as info:
        jax.jit(lambda x, w: cm.dot_general(
            x, w, DN_LAST(2), out_sharding=P(None, "x")))(x, w)
  assert "float32" in str(info.value) and "bfloat16" in str(info.value)


def test_non_strict_mismatched_dtypes_return_plain_result(keys):
  mesh, x, w = _operands(keys, "float32", "bfloat16")
  f = lambda dot: jax.jit(lambda x, w: dot(
      x, w, DN_LAST(2), out_sharding=P(None, "x")))
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl="ring", strict=False):
      y = f(cm.dot_general)(x, w)
    plain = f(lax.dot_general)(x, w)
  (decision,) = cm.decisions()
  assert not decision.rewritten and "dtypes differ" in decision.reason
  assert jax.typeof(y) == jax.typeof(plain)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(plain))


@pytest.mark.parametrize("w_spec", [P(None, None), P("x", None)],
                         ids=["rhs_replicated", "rhs_contracting"])
def test_strict_pattern_free_dot_general_does_not_raise(w_spec, keys):
  mesh, x, w = _operands(keys, "float32", "float32", w_spec=w_spec)
  out = P("x", None)
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl="pallas", strict=True):
      y = jax.jit(lambda x, w: cm.dot_general(
          x, w, DN_LAST(2), out_sharding=out))(x, w)
    plain = jax.jit(lambda x, w: lax.dot_general(
        x, w, DN_LAST(2), out_sharding=out))(x, w)
  assert [d.rewritten for d in cm.decisions()] == [False]
  np.testing.assert_array_equal(np.asarray(y), np.asarray(plain))


def test_strict_unsharded_operands_do_not_raise(keys):
  x = normal(keys(), (16, 32), "float32")
  w = normal(keys(), (32, 16), "float32")
  with cm.config_context(enabled=True, impl="ring", strict=True):
    y = jax.jit(lambda x, w: cm.dot_general(x, w, DN_LAST(2)))(x, w)
  assert [d.rewritten for d in cm.decisions()] == [False]
  np.testing.assert_array_equal(
      np.asarray(y), np.asarray(lax.dot_general(x, w, DN_LAST(2))))


def test_a_reason_every_rewrite_shares_is_said_once(keys):
  """On CPU every rewrite gives the same 'pallas unavailable' reason: the
  summary says it once, in its header, not on each line."""
  mesh, x, w = _operands(keys)
  cm.clear_decisions()
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl="pallas"):
      for name in ("a", "b", "c"):
        jax.jit(lambda x, w, name=name: cm.dot_general(
            x, w, DN_LAST(2), name=name))(x, w)
  summary = cm.format_decisions()
  assert summary.count("pallas unavailable") == 1, summary
  assert summary.splitlines()[0].startswith(
      "collective matmul: 3 of 3 dot_generals rewritten (each: pallas "
      "unavailable")
