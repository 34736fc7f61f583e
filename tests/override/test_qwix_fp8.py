"""`qwix_fp8.dot_general_qt` against Qwix's own `dot_general_qt` (0.1.8), in
the configs Qwix's `QtProvider` builds for MaxText's fp8 modes: the same
result and gradients up to the ring's order of sums (float32), with the
products recorded as rewritten rowwise fp8; with logical axis rules (as
MaxText names its axes), for the all-gather projection and the
reduce-scatter one; through jit, grad, vmap,
checkpoint and export; and a bypass of the scales caught. Python 3.12 (Qwix
is MaxText's)."""
import contextlib
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

qwix_qt = pytest.importorskip("qwix._src.core.dot_general_qt")

import collective_matmul as cm  # pylint: disable=g-import-not-at-top
from collective_matmul import override  # pylint: disable=g-import-not-at-top
from collective_matmul import qwix_fp8  # pylint: disable=g-import-not-at-top
from cm_test_utils import mesh_1d, normal  # pylint: disable=g-import-not-at-top

D, B, S, E, F = 4, 2, 16, 64, 32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
DIMS = (((2,), (0,)), ((), ()))
# The rules of MaxText 0.2.5's quantizations.py as Qwix's QtProvider turns
# them into a config for activation x weight: fp8_full (e4m3 forward, e5m2
# gradients, untiled), and make_qt_rule's fp8 / fp8_e4m3 / fp8_e5m2 (one
# dtype throughout, the weight's gradient tiled over the rows).
MODES = {
    "fp8_full": qwix_qt.DotGeneralQtConfig(
        lhs_qtype=E4M3, rhs_qtype=E4M3, dlhs_grad_qtype=E5M2,
        drhs_grad_qtype=E5M2),
    **{mode: qwix_qt.DotGeneralQtConfig(
        lhs_qtype=dtype, rhs_qtype=dtype, dlhs_grad_qtype=dtype,
        drhs_grad_qtype=dtype, drhs_tile_size=0.5)
       for mode, dtype in (("fp8", E4M3), ("fp8_e4m3", E4M3),
                           ("fp8_e5m2", E5M2))}}
# Float32 arithmetic on the same fp8 values, summed in another order.
TOLERANCE = 1e-5
RULES = (("batch", None), ("seq", "x"), ("mlp", "x"), ("embed", None))
PATTERNS = {
    # lhs [B, S, k] rows sharded, rhs [k, n] columns sharded.
    "all_gather": ((E, D * F), P(None, "x", None), P(None, "x"),
                   dict(lhs_axes=("batch", "seq", "embed"),
                        rhs_axes=("embed", "mlp"))),
    # lhs [B, S, k] contraction sharded, the result scattered on S.
    "reduce_scatter": ((D * E, F), P(None, None, "x"), P("x", None),
                       dict(lhs_axes=("batch", None, "mlp"),
                            rhs_axes=("mlp", "embed"),
                            out_axes=("batch", "seq", "embed"))),
}


@contextlib.contextmanager
def _on(mesh, **config):
  """The mesh and MaxText-like logical rules; the plugin configured as
  `config` says (off without)."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES), cm.config_context(
      **config):
    yield


def _operands(keys, pattern):
  mesh = mesh_1d(D, AxisType.Auto)
  (k, n), lhs_spec, rhs_spec, axes = PATTERNS[pattern]
  lhs = normal(keys(), (B, D * S, k), jnp.float32)
  rhs = normal(keys(), (k, n), jnp.float32)
  # Rows and columns of different magnitudes, so that per-tensor scales
  # would not do.
  lhs = lhs * jnp.exp(normal(keys(), (B, D * S, 1), jnp.float32))
  rhs = rhs * jnp.exp(normal(keys(), (1, n), jnp.float32))
  lhs = jax.device_put(lhs, NamedSharding(mesh, lhs_spec))
  rhs = jax.device_put(rhs, NamedSharding(mesh, rhs_spec))
  return mesh, lhs, rhs, axes


def _ours(config, axes):
  return functools.partial(qwix_fp8.dot_general_qt, dimension_numbers=DIMS,
                           config=config, name="proj", **axes)


def _qwix(config):
  return functools.partial(qwix_qt.dot_general_qt, dimension_numbers=DIMS,
                           config=config)


def _value_and_grads(f, t):
  return jax.jit(jax.value_and_grad(lambda a, b: jnp.sum(f(a, b) * t),
                                    (0, 1)))


# A gradient's quantized cotangent is rounded to fp8 from float32 values
# that the ring and Qwix compute in a different order; where one lands on
# an fp8 rounding boundary, that one element rounds the other way, and the
# one row of the lhs gradient that uses it moves along one weight column
# (CM_TEST_SEED=1129076247, fp8_e4m3 all-gather: row [1, 6] only, the
# difference parallel to weight column 38 to 0.9997, norm error 3.8e-4).
# So a gradient may differ in at most one row, and by at most this much of
# its norm; a scale on the wrong axis or a bypassed one moves every row.
FLIP_NORM = 1e-3


def _assert_close(got, want, tolerance=TOLERANCE, flipped_rows=0):
  """Each leaf within `tolerance` (of its largest entry) elementwise, but
  for at most `flipped_rows` rows (vectors along the last axis) off by an
  fp8 rounding flip (`FLIP_NORM`)."""
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert g.shape == w.shape
    atol = tolerance * np.max(np.abs(w))
    off = ~np.isclose(g, w, rtol=tolerance, atol=atol)
    rows = np.argwhere(off.reshape(-1, g.shape[-1] if g.ndim else 1).any(
        axis=-1)).ravel()
    if g.ndim >= 2 and 0 < len(rows) <= flipped_rows:
      assert np.linalg.norm(g - w) <= FLIP_NORM * np.linalg.norm(w), rows
      continue
    np.testing.assert_allclose(g, w, rtol=tolerance, atol=atol)


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_result_and_gradients_are_qwix_s(mode, pattern, keys):
  mesh, lhs, rhs, axes = _operands(keys, pattern)
  config = MODES[mode]
  with _on(mesh):
    want_y = jax.jit(_qwix(config))(lhs, rhs)
    t = normal(keys(), want_y.shape, jnp.float32)
    want = _value_and_grads(_qwix(config), t)(lhs, rhs)
  cm.clear_decisions()
  with _on(mesh, enabled=True, impl="ring"):
    got_y = jax.jit(_ours(config, axes))(lhs, rhs)
    got = _value_and_grads(_ours(config, axes), t)(lhs, rhs)
  _assert_close(got_y, want_y)
  _assert_close(got, want, flipped_rows=1)
  records = {d.name: d for d in cm.decisions()}
  fwd_dtype = {"fp8_e5m2": "e5m2 x e5m2"}.get(mode, "e4m3 x e4m3")
  bwd_dtype = {"fp8_full": "e5m2 x e4m3", "fp8_e5m2": "e5m2 x e5m2"}.get(
      mode, "e4m3 x e4m3")
  assert records["proj"].rewritten and records["proj/dgrad"].rewritten
  assert records["proj"].dtype == f"{fwd_dtype} -> f32 rowwise"
  assert records["proj/dgrad"].dtype == f"{bwd_dtype} -> f32 rowwise"


@pytest.mark.parametrize("per_tensor", ["weight", "both"])
def test_per_tensor_scales_of_qwix_are_served_as_its_own(per_tensor, keys):
  """Qwix's `disable_channelwise_axes` (one scale per tensor): a
  row-scaled activation with a per-tensor weight, or both per tensor,
  through the same row and column scales (broadcast), equal to Qwix's."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  mesh, lhs, rhs, axes = _operands(keys, "reduce_scatter")
  config = dataclasses.replace(
      MODES["fp8_full"], rhs_disable_channelwise_axes=True,
      lhs_disable_channelwise_axes=per_tensor == "both")
  t = normal(keys(), (B, D * S, F), jnp.float32)
  with _on(mesh):
    want = _value_and_grads(_qwix(config), t)(lhs, rhs)
  with _on(mesh, enabled=True, impl="ring"):
    got = _value_and_grads(_ours(config, axes), t)(lhs, rhs)
  _assert_close(got, want, flipped_rows=1)


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_a_bypass_of_the_scales_is_caught(pattern, keys):
  """The positive control: the same fp8 values through the drop-in
  without their row and column scales (dequantized per tensor by their
  means) are far from Qwix's result."""
  mesh, lhs, rhs, axes = _operands(keys, pattern)
  config = MODES["fp8_full"]
  with _on(mesh):
    want = jax.jit(_qwix(config))(lhs, rhs)
    _, residuals = qwix_qt.dot_general_qt_fwd(lhs, rhs, *[
        qwix_fp8._calibration(a, DIMS, (3, 2), i == 0, config)  # pylint: disable=protected-access
        for i, a in enumerate((lhs, rhs))], DIMS, config)
  lhs_q, rhs_q = residuals[2], residuals[3]
  cm.clear_decisions()
  with _on(mesh, enabled=True, impl="ring"):
    bypassed = override.collective_dot_general(
        lhs_q.qvalue, rhs_q.qvalue, DIMS, None, jnp.float32,
        scale=jnp.mean(lhs_q.scale) * jnp.mean(rhs_q.scale), **axes)
  assert cm.decisions()[-1].rewritten
  error = np.max(np.abs(np.asarray(bypassed) - np.asarray(want)))
  assert error > 100 * TOLERANCE * np.max(np.abs(np.asarray(want)))


@pytest.mark.parametrize("mapped", ["lhs", "rhs"])
def test_vmap_of_grad_is_qwix_s(mapped, keys):
  mesh, lhs, rhs, axes = _operands(keys, "all_gather")
  config = MODES["fp8_full"]
  in_axes = (0, None) if mapped == "lhs" else (None, 0)
  args = [jnp.stack([a, 2 * a]) if axis == 0 else a
          for a, axis in zip((lhs, rhs), in_axes)]
  grad = lambda f: jax.grad(lambda a, b: jnp.sum(jnp.square(f(a, b))),
                            (0, 1))
  with _on(mesh):
    want = jax.jit(jax.vmap(grad(_qwix(config)), in_axes))(*args)
  with _on(mesh, enabled=True, impl="ring"):
    got = jax.jit(jax.vmap(grad(_ours(config, axes)), in_axes))(*args)
  _assert_close(got, want, flipped_rows=1)


def test_checkpoint_gives_the_same_gradients(keys):
  mesh, lhs, rhs, axes = _operands(keys, "reduce_scatter")
  config = MODES["fp8"]
  loss = lambda f: lambda a, b: jnp.sum(jnp.square(f(a, b)))
  f = _ours(config, axes)
  with _on(mesh, enabled=True, impl="ring"):
    got = jax.jit(jax.grad(loss(jax.checkpoint(
        f, policy=jax.checkpoint_policies.dots_saveable)), (0, 1)))(lhs, rhs)
    want = jax.jit(jax.grad(loss(f), (0, 1)))(lhs, rhs)
  _assert_close(got, want, flipped_rows=1)


def test_forward_mode_raises_as_qwix_s(keys):
  """Qwix's dot_general_qt is a custom VJP: jvp raises TypeError there and
  here."""
  mesh, lhs, rhs, axes = _operands(keys, "all_gather")
  config = MODES["fp8_full"]
  tangents = (jnp.ones_like(lhs), jnp.ones_like(rhs))
  with _on(mesh), pytest.raises(TypeError):
    jax.jvp(_qwix(config), (lhs, rhs), tangents)
  with _on(mesh, enabled=True, impl="ring"), pytest.raises(TypeError):
    jax.jvp(_ours(config, axes), (lhs, rhs), tangents)


def test_an_exported_step_runs_the_same(keys):
  mesh, lhs, rhs, axes = _operands(keys, "all_gather")
  config = MODES["fp8_e4m3"]
  with _on(mesh, enabled=True, impl="ring"):
    step = jax.jit(jax.value_and_grad(
        lambda a, b: jnp.sum(jnp.square(_ours(config, axes)(a, b))), (0, 1)))
    exported = jax.export.export(step)(lhs, rhs)
    _assert_close(exported.call(lhs, rhs), step(lhs, rhs), 0.0)


@pytest.mark.parametrize("change,match", [
    (dict(tile_size=16), "subchannel tiles"),
    (dict(lhs_qtype=jnp.int8, rhs_qtype=jnp.int8), "qtype int8"),
    (dict(dlhs_grad_qtype=None), "gradient qtype None"),
    (dict(lhs_calibration_method="minmax"), "asymmetric"),
    (dict(use_original_residuals=True), "original"),
])
def test_configs_it_does_not_serve_are_refused_naming_why(change, match,
                                                          keys):
  mesh, lhs, rhs, axes = _operands(keys, "all_gather")
  import dataclasses  # pylint: disable=g-import-not-at-top
  config = dataclasses.replace(MODES["fp8_full"], **change)
  assert match in qwix_fp8.unserved_reason(config, lhs, rhs, DIMS)
  with _on(mesh), pytest.raises(ValueError, match=match):
    _ours(config, axes)(lhs, rhs)


@pytest.mark.skipif(
    tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 12),
    reason="Mosaic GPU lowers off GPU from JAX 0.12 on")
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_on_hopper_auto_runs_the_rowwise_kernels(mode, pattern, monkeypatch):
  """On devices described as H200s (lowered for CUDA, nothing runs), at
  sizes the kernels win: the forward and the activations' gradient (dgrad)
  of the three e4m3 modes through the fp8 kernels with Qwix's row and
  column scales (fp8_full's dgrad e5m2 x e4m3), the weight's gradient
  Qwix's own; fp8_e5m2's e5m2 weight, which the kernels do not take, XLA's
  GEMM, the reason recorded."""
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  monkeypatch.setattr(cm.selection, "device_facts",
                      lambda mesh=None: cm.selection.DeviceFacts(
                          "gpu", "NVIDIA H200", 132, 1, 8))
  mesh = mesh_1d(D, AxisType.Auto)
  (k, n), lhs_spec, rhs_spec, axes = PATTERNS[pattern]
  grow = 64  # local 2048 x 4096 x 2048 (all-gather's), 32 x 16 tiles.
  lhs = jax.ShapeDtypeStruct((B, D * S * grow, k * grow), jnp.float32,
                             sharding=NamedSharding(mesh, lhs_spec))
  rhs = jax.ShapeDtypeStruct((k * grow, n * grow), jnp.float32,
                             sharding=NamedSharding(mesh, rhs_spec))
  f = _ours(MODES[mode], axes)
  with _on(mesh, enabled=True, impl="auto"):
    text = jax.jit(jax.value_and_grad(lambda a, b: jnp.sum(f(a, b)),
                                      (0, 1))).trace(lhs, rhs).lower(
                                          lowering_platforms=("cuda",)
                                      ).as_text()
  decisions = [d for d in cm.decisions() if d.rewritten]
  assert len(decisions) == 2  # The forward and the dgrad.
  assert all(d.dtype.endswith(" rowwise") for d in decisions)
  kernels = len(re.findall(r"custom_call @mosaic_gpu", text))
  if mode == "fp8_e5m2":
    assert kernels == 0
    assert all(d.what_runs().startswith("baseline") and "float8_e5m2 x "
               "float8_e5m2" in str(d) for d in decisions)
  else:
    assert kernels == 2
    assert all(d.what_runs().startswith("pallas") for d in decisions)
