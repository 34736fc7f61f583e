"""cm.einsum: jnp.einsum's contract, with the collective matmul inside
(Explicit meshes: the operands' types carry the sharding)."""
import re

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from cm_test_utils import TOLERANCE, assert_close, mesh_1d, mesh_2d
from cm_test_utils import normal, put
from cm_test_utils import compiled_hlo, hlo_diff, normalized_hlo

# name: (mesh, equation, x shape, x spec, w shape, w spec, out_sharding,
#        pattern, numpy equation for the reference (no ellipsis)).
CASES = {
    "rows": (lambda: mesh_1d(4), "mk,kn->mn", (16, 32), P("x", None),
             (32, 24), P(None, "x"), None, "all_gather", "mk,kn->mn"),
    # praxis Linear's equation, activation sharded on batch and sequence.
    "linear_ellipsis": (lambda: mesh_2d((2, 4)), "...y,yz->...z", (4, 8, 32),
                        P("data", "tensor", None), (32, 16),
                        P(None, "tensor"), None, "all_gather", "bsy,yz->bsz"),
    # Attention q/k/v projection: the weight's output dims are (heads, dim).
    "qkv_heads": (lambda: mesh_2d((2, 4)), "BTD,DNH->BTNH", (2, 8, 32),
                  P("data", "tensor", None), (32, 8, 4),
                  P(None, "tensor", None), None, "all_gather",
                  "BTD,DNH->BTNH"),
    # Attention output projection: two contracting dims (heads, dim).
    "out_proj_gather": (lambda: mesh_2d((2, 4)), "bsnh,nhd->bsd",
                        (2, 8, 4, 8), P("data", "tensor", None, None),
                        (4, 8, 16), P(None, None, "tensor"), None,
                        "all_gather", "bsnh,nhd->bsd"),
    "out_proj_scatter": (lambda: mesh_2d((2, 4)), "bsnh,nhd->bsd",
                         (2, 8, 8, 4), P("data", None, "tensor", None),
                         (8, 4, 16), P("tensor", None, None),
                         P("data", "tensor", None), "reduce_scatter",
                         "bsnh,nhd->bsd"),
    "mlp_out_scatter": (lambda: mesh_1d(4), "bsf,fd->bsd", (2, 8, 32),
                        P(None, None, "x"), (32, 16), P("x", None),
                        P(None, "x", None), "reduce_scatter", "bsf,fd->bsd"),
    # The result in another order than the dot_general's: a transpose.
    "transposed_result": (lambda: mesh_2d((2, 4)), "bsk,kn->nbs", (4, 8, 32),
                          P("data", "tensor", None), (32, 16),
                          P(None, "tensor"), None, "all_gather",
                          "bsk,kn->nbs"),
}


def _inputs(case, keys, dtype="float32"):
  make_mesh, eq, x_shape, x_spec, w_shape, w_spec, out, _, np_eq = (
      CASES[case])
  mesh = make_mesh()
  x = put(normal(keys(), x_shape, dtype), mesh, x_spec)
  w = put(normal(keys(), w_shape, dtype), mesh, w_spec)
  return mesh, eq, x, w, out, np_eq


def _f64(a):
  return np.asarray(a, np.float64)


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_einsum_is_rewritten_and_matches_reference(case, dtype, impl, keys):
  mesh, eq, x, w, out, np_eq = _inputs(case, keys, dtype)
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl=impl):
    y = jax.jit(lambda x, w: cm.einsum(eq, x, w, out_sharding=out))(x, w)
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.impl == impl, decision
  assert decision.collective == CASES[case][7] and decision.mode == "explicit"
  assert decision.name == f"einsum({eq!r})"
  assert y.dtype == jnp.dtype(dtype)
  if out is not None:
    assert jax.typeof(y).sharding.spec == out
  assert_close(y, np.einsum(np_eq, _f64(x), _f64(w)), TOLERANCE[dtype])


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("case", ["linear_ellipsis", "out_proj_scatter",
                                  "transposed_result"])
def test_einsum_grads_match_jnp_einsum_and_reference(case, impl, keys):
  mesh, eq, x, w, out, np_eq = _inputs(case, keys)
  y_spec = out
  if y_spec is None:  # What the rewrite produces; jnp.einsum needs it said.
    with jax.set_mesh(mesh), cm.config_context(enabled=True, impl=impl):
      y_spec = jax.typeof(jax.jit(lambda x, w: cm.einsum(eq, x, w))(
          x, w)).sharding.spec
  cm.clear_decisions()
  cot = put(normal(keys(), np.einsum(np_eq, _f64(x), _f64(w)).shape,
                   "float32"), mesh, y_spec)

  def loss(einsum, x, w, cot):
    return jnp.sum(jnp.sin(einsum(eq, x, w, out_sharding=y_spec)) * cot)

  grad = lambda einsum: jax.jit(jax.grad(
      lambda *a: loss(einsum, *a), argnums=(0, 1)))(x, w, cot)
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl=impl):
      dx, dw = grad(cm.einsum)
    dx_ref, dw_ref = grad(jnp.einsum)
  assert [d.rewritten for d in cm.decisions()] == [True]
  assert jax.typeof(dx).sharding.spec == jax.typeof(x).sharding.spec
  assert jax.typeof(dw).sharding.spec == jax.typeof(w).sharding.spec
  assert_close(dx, _f64(dx_ref), 1e-5)
  assert_close(dw, _f64(dw_ref), 1e-5)
  # float64: dy = cos(y) * cot; the einsum's transposes give dx and dw.
  inputs, result = np_eq.split("->")
  a, b = inputs.split(",")
  dy = np.cos(np.einsum(np_eq, _f64(x), _f64(w))) * _f64(cot)
  assert_close(dx, np.einsum(f"{result},{b}->{a}", dy, _f64(w)), 1e-5)
  assert_close(dw, np.einsum(f"{a},{result}->{b}", _f64(x), dy), 1e-5)


def test_decision_is_named_after_the_layer(keys):
  mesh, eq, x, w, out, _ = _inputs("linear_ellipsis", keys)
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    jax.jit(lambda x, w: cm.einsum(eq, x, w, name="mlp/wi_0"))(x, w)
  (decision,) = cm.decisions()
  assert decision.name == "mlp/wi_0" and decision.axis == "tensor"
  assert "mlp/wi_0" in cm.format_decisions()
  assert "rewritten -> ring over 'tensor'" in cm.format_decisions()


def test_preferred_element_type_is_the_result_dtype(keys):
  mesh, eq, x, w, _, np_eq = _inputs("qkv_heads", keys, "bfloat16")
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    y = jax.jit(lambda x, w: cm.einsum(
        eq, x, w, preferred_element_type=jnp.float32))(x, w)
  (decision,) = cm.decisions()
  assert decision.rewritten
  assert y.dtype == jnp.float32
  assert_close(y, np.einsum(np_eq, _f64(x), _f64(w)), TOLERANCE["float32"])


def test_interleaved_operand_form_is_rewritten(keys):
  mesh, _, x, w, _, _ = _inputs("rows", keys)
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    y = jax.jit(lambda x, w: cm.einsum(x, [0, 1], w, [1, 2], [0, 2]))(x, w)
  (decision,) = cm.decisions()
  assert decision.rewritten
  assert_close(y, _f64(x) @ _f64(w), TOLERANCE["float32"])


def test_unsharded_contraction_is_left_as_jnp_einsum_would_compute_it(keys):
  """Plugin on, no pattern: lax.dot_general, the same program jnp.einsum's."""
  mesh = mesh_1d(4)
  x = put(normal(keys(), (4, 8, 32), "float32"), mesh, P())
  w = put(normal(keys(), (32, 16), "float32"), mesh, P())
  eq = "...y,yz->...z"
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl="ring"):
      ours = jax.jit(lambda x, w: cm.einsum(eq, x, w))
      y, text = ours(x, w), ours.lower(x, w).compile().as_text()
    plain = jax.jit(lambda x, w: jnp.einsum(eq, x, w))
    y_ref, text_ref = plain(x, w), plain.lower(x, w).compile().as_text()
  (decision,) = cm.decisions()
  assert not decision.rewritten and "no mesh axis" in decision.reason
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
  assert _normalized(text) == _normalized(text_ref)


# -------------------------------------------- left to jnp.einsum, unchanged

UNSUPPORTED = {
    # name: (equation, operand shapes, operand specs, words of the reason)
    "three_operands": ("ij,jk,kl->il", [(8, 16), (16, 8), (8, 4)],
                       [P("x", None), P(None, "x"), P()], "3 operand"),
    "ellipsis_only": ("...,...->...", [(8, 16), (8, 16)],
                      [P("x", None), P("x", None)], "batch dimension"),
    "one_operand": ("ij->ji", [(8, 16)], [P("x", None)], "1 operand"),
    "batch_dims": ("bij,bjk->bik", [(4, 8, 16), (4, 16, 8)],
                   [P("x", None, None), P("x", None, None)],
                   "batch dimension"),
    "diagonal": ("ii,ij->j", [(8, 8), (8, 16)], [P(), P(None, "x")],
                 "repeats index 'i'"),
    "summed_index": ("ij,jk->k", [(8, 16), (16, 8)], [P(), P(None, "x")],
                     "'i' of one operand only is summed"),
    "outer_product": ("i,j->ij", [(8,), (16,)], [P("x"), P()],
                      "outer product"),
    "broadcast_size_one": ("ij,jk->ik", [(8, 1), (16, 8)],
                           [P("x", None), P()], "broadcast"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_einsum_is_jnp_einsum(case, keys):
  eq, shapes, specs, reason = UNSUPPORTED[case]
  mesh = mesh_1d(4)
  operands = [put(normal(keys(), s, "float32"), mesh, p)
              for s, p in zip(shapes, specs)]
  with jax.set_mesh(mesh):
    with cm.config_context(enabled=True, impl="ring"):
      y = jax.jit(lambda *ops: cm.einsum(eq, *ops))(*operands)
    y_ref = jax.jit(lambda *ops: jnp.einsum(eq, *ops))(*operands)
  (decision,) = cm.decisions()
  assert not decision.rewritten and reason in decision.reason, decision
  assert "jnp.einsum" in decision.reason
  assert jax.typeof(y) == jax.typeof(y_ref)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))


def test_jnp_einsum_errors_are_raised_unchanged():
  x, w = np.ones((4, 8), np.float32), np.ones((16, 2), np.float32)
  with cm.config_context(enabled=True, impl="ring"):
    for args, kwargs in ((("ij,jk->ik", x, w), {}),       # sizes differ
                         (("ij,jk->iz", x, x.T), {}),     # unknown output
                         (("ij,jk->ik", x, x.T), {"out": x})):
      with pytest.raises(Exception) as ours:
        cm.einsum(*args, **kwargs)
      with pytest.raises(Exception) as theirs:
        jnp.einsum(*args, **kwargs)
      assert type(ours.value) is type(theirs.value)
      assert str(ours.value) == str(theirs.value)
  assert not cm.decisions()


# ------------------------------------------------------------ compiled HLO


_compiled = compiled_hlo
_normalized = normalized_hlo


@pytest.mark.parametrize("case", ["linear_ellipsis", "out_proj_gather",
                                  "out_proj_scatter"])
def test_ring_program_has_no_collective_around_the_dot(case, keys):
  mesh, eq, x, w, out, _ = _inputs(case, keys)
  text = _compiled(mesh, lambda x, w: cm.einsum(eq, x, w, out_sharding=out),
                   x, w, enabled=True, impl="ring")
  assert [d.rewritten for d in cm.decisions()] == [True]
  assert "all-gather" not in text and "reduce-scatter" not in text
  assert "all-reduce" not in text
  assert "collective-permute" in text


@pytest.mark.parametrize("case", ["linear_ellipsis", "out_proj_gather"])
def test_jnp_einsum_program_all_gathers_the_activation(case, keys):
  """The check above can fail: jnp.einsum's own program has the all-gather
  of the activation (its per-device shape grown back over 'tensor')."""
  mesh, eq, x, w, _, _ = _inputs(case, keys)
  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    out = jax.typeof(jax.jit(lambda x, w: cm.einsum(eq, x, w))(
        x, w)).sharding.spec
  text = _compiled(mesh, lambda x, w: jnp.einsum(eq, x, w, out_sharding=out),
                   x, w)
  # Gathered over 'tensor' (the sequence), still sharded over 'data'.
  shape = ",".join(map(str, (x.shape[0] // 2,) + x.shape[1:]))
  assert re.search(rf"f32\[{shape}\]\S* all-gather\(", text), text
  assert "collective-permute" not in text


def test_jnp_einsum_program_reduce_scatters_the_output_projection(keys):
  mesh, eq, x, w, out, _ = _inputs("out_proj_scatter", keys)
  text = _compiled(mesh, lambda x, w: jnp.einsum(eq, x, w, out_sharding=out),
                   x, w)
  assert "reduce-scatter" in text or "all-reduce" in text, text
  assert "collective-permute" not in text


@pytest.mark.parametrize("case", ["linear_ellipsis", "out_proj_scatter",
                                  "transposed_result"])
def test_plugin_off_is_jnp_einsum_program(case, keys):
  mesh, eq, x, w, _, _ = _inputs(case, keys)
  y_spec = {"linear_ellipsis": P("data", None, "tensor"),
            "out_proj_scatter": P("data", "tensor", None),
            "transposed_result": P("tensor", "data", None)}[case]
  plugin = lambda x, w: cm.einsum(eq, x, w, out_sharding=y_spec)
  plain = lambda x, w: jnp.einsum(eq, x, w, out_sharding=y_spec)
  with jax.set_mesh(mesh), cm.config_context(enabled=False, impl="ring"):
    lowered_off = jax.jit(plugin).lower(x, w).as_text()
    lowered_ref = jax.jit(plain).lower(x, w).as_text()
  assert lowered_off == lowered_ref
  off = _compiled(mesh, plugin, x, w, enabled=False, impl="ring")
  reference = _compiled(mesh, plain, x, w)
  assert not cm.decisions()
  diff = hlo_diff(reference, off, ("jnp.einsum", "cm.einsum (off)"))
  assert not diff, diff
  # A new function object (jit's cache does not key on the configuration):
  # the same call with the plugin on is a different program.
  on = _compiled(mesh, lambda x, w: plugin(x, w), x, w, enabled=True,
                 impl="ring")
  assert [d.rewritten for d in cm.decisions()] == [True]
  assert _normalized(on) != _normalized(reference)


# --------------------------------------------------------------- Flax NNX


def test_nnx_einsum_with_plugin_matches_plain_einsum(keys):
  mesh, _, x, _, _, _ = _inputs("linear_ellipsis", keys)
  seed = int(jax.random.randint(keys(), (), 0, 2**30))
  make = lambda op: nnx.Einsum("bsd,df->bsf", (32, 16), (16,),
                               einsum_op=op, rngs=nnx.Rngs(seed))
  with jax.set_mesh(mesh):
    plain, plugged = make(jnp.einsum), make(cm.einsum)
    np.testing.assert_array_equal(np.asarray(plain.kernel[...]),
                                  np.asarray(plugged.kernel[...]))
    bias = normal(keys(), (16,), "float32")
    for layer in (plain, plugged):
      layer.kernel = nnx.Param(put(layer.kernel[...], mesh, P(None, "tensor")))
      layer.bias = nnx.Param(put(bias, mesh, P()))
    out = P("data", None, "tensor")
    call = nnx.jit(lambda layer, x, out: layer(x, out_sharding=out),
                   static_argnums=2)
    y_plain = call(plain, x, out)
    assert not cm.decisions()
    with cm.config_context(enabled=True, impl="ring"):
      y = call(plugged, x, None)  # No out_sharding needed with the plugin.
  (decision,) = cm.decisions()
  assert decision.rewritten and decision.name == "einsum('bsd,df->bsf')"
  assert jax.typeof(y).sharding.spec == out
  assert_close(y, _f64(y_plain), TOLERANCE["float32"])
  kernel = _f64(plugged.kernel[...])
  assert_close(y, _f64(x) @ kernel + _f64(bias), TOLERANCE["float32"])


def test_nnx_einsum_grads_match_plain_einsum(keys):
  mesh, _, x, _, _, _ = _inputs("linear_ellipsis", keys)
  out = P("data", None, "tensor")
  grads = {}
  with jax.set_mesh(mesh):
    for name, op in (("plain", jnp.einsum), ("plugin", cm.einsum)):
      layer = nnx.Einsum("bsd,df->bsf", (32, 16), (16,), einsum_op=op,
                         rngs=nnx.Rngs(3))
      layer.kernel = nnx.Param(put(layer.kernel[...], mesh, P(None, "tensor")))
      loss = lambda layer, x: jnp.sum(jnp.tanh(layer(x, out_sharding=out)))
      with cm.config_context(enabled=True, impl="ring"):
        grads[name] = nnx.jit(nnx.grad(loss))(layer, x)
  assert [d.rewritten for d in cm.decisions()] == [True]
  for attr in ("kernel", "bias"):
    assert_close(getattr(grads["plugin"], attr)[...],
                 _f64(getattr(grads["plain"], attr)[...]), 1e-5)
