"""The ops' per-tensor `scale`: the f32 accumulation times the scale, then
the cast (`ring` and `baseline`, the executable spec of the kernels'
epilogue), against a float64 reference; `grad` (the scale's too), `jvp`,
`vmap` (the scale mapped too) and `checkpoint` against the same program
written with XLA's collectives; and `cm.fp8_scaled_dot_general`, whose
forward and dgrad pass the product of the scales into the collective
matmul, against Flax's `fp8_scaled_dot_general`."""
import functools

import flax.linen as nn
from flax.linen import fp8_ops
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from collective_matmul import override
from cm_test_utils import mesh_1d, normal, put

D, M, K, N = 4, 8, 64, 16
E4M3 = jnp.float8_e4m3fn
# bf16's unit roundoff (8 significant bits): one rounding of a result.
BF16_U = 2.0**-8
OPS = {"all_gather": (cm.all_gather_matmul,
                      (P("x", None), P(None, "x")), P(None, "x")),
       "reduce_scatter": (cm.matmul_reduce_scatter,
                          (P(None, "x"), P("x", None)), P("x", None))}


def _exact(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _quantized_both_ways(v, scale, amax_history):
  """`v` quantized as Flax's `in_q` does (clip(v / scale) in f32, to e4m3)
  and as a jitted program may do it: XLA's algebraic simplifier turns a
  division by a broadcast scalar into a multiplication by its reciprocal,
  whose f32 quotient can fall on the other side of an e4m3 tie (with
  CM_TEST_SEED=1825679723, x / s = -336 exactly, half-way between 320 and
  352, rounds to even -320, while x * (1 / s) = -336.00003 rounds to -352;
  the ring and `baseline` alike). Returns ([Flax's fp8 values, the
  reciprocal's], the scale), the values as float64."""
  q, s = fp8_ops.in_q(jnp.float32, E4M3, v, scale, amax_history)
  s = np.float32(np.asarray(s).item())
  qmax = np.float32(jnp.finfo(E4M3).max)
  v = np.asarray(jnp.asarray(v, jnp.float32))
  rcp = jnp.asarray(np.clip(v * (np.float32(1) / s), -qmax, qmax)).astype(E4M3)
  return [_exact(q), _exact(rcp)], float(s)


def _exact_fp8_products(spec, quantized_x, quantized_w):
  """The exact scaled products of the fp8 values a jitted program may
  multiply (each operand quantized either way: `_quantized_both_ways`);
  Flax's first."""
  (q_xs, s_x), (q_ws, s_w) = quantized_x, quantized_w
  assert s_x != 1.0 and s_w != 1.0
  return [np.einsum(spec, q_x, q_w) * s_x * s_w
          for q_x in q_xs for q_w in q_ws]


def _nearest(y, products):
  """|y - p| for the product p nearest y, elementwise."""
  return np.min([np.abs(y - p) for p in products], axis=0)


def _operands(keys, collective, dtype):
  mesh = mesh_1d(D, jax.sharding.AxisType.Auto)
  if collective == "all_gather":
    x = normal(keys(), (D * M, K), jnp.float32).astype(dtype)
    w = normal(keys(), (K, D * N), jnp.float32).astype(dtype)
  else:
    x = normal(keys(), (D * M, D * K), jnp.float32).astype(dtype)
    w = normal(keys(), (D * K, N), jnp.float32).astype(dtype)
  scale = jax.random.uniform(keys(), (), jnp.float32, 0.25, 4.0)
  return mesh, x, w, scale


def _ours(collective, mesh, impl, **kwargs):
  """f(x, w, scale): the op over the whole mesh."""
  op, in_specs, out_spec = OPS[collective]
  return jax.shard_map(
      lambda x, w, s: op(x, w, "x", impl=impl, scale=s, **kwargs),
      mesh=mesh, in_specs=in_specs + (P(),), out_specs=out_spec)


def _xla(collective, mesh, preferred_element_type=None):
  """The same product written with XLA's collectives: scale times the f32
  accumulation, cast to the result's dtype."""
  _, in_specs, out_spec = OPS[collective]

  def body(x, w, s):
    if collective == "all_gather":
      x = lax.all_gather(x, "x", tiled=True)
    out_dtype = preferred_element_type or x.dtype
    acc = lax.dot(x, w, preferred_element_type=jnp.float32) * s
    if collective == "reduce_scatter":
      acc = lax.psum_scatter(acc, "x", tiled=True)
    return acc.astype(out_dtype)
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs + (P(),),
                       out_specs=out_spec)


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("collective", sorted(OPS))
@pytest.mark.parametrize("dtype,out_dtype", [
    (jnp.float32, None), (jnp.bfloat16, None), (E4M3, jnp.bfloat16),
    (E4M3, jnp.float32)], ids=["f32", "bf16", "e4m3_bf16", "e4m3_f32"])
def test_scaled_ops_are_the_scaled_accumulation_rounded_once(
    impl, collective, dtype, out_dtype, keys):
  mesh, x, w, scale = _operands(keys, collective, dtype)
  y = jax.jit(_ours(collective, mesh, impl,
                    preferred_element_type=out_dtype))(x, w, scale)
  out_dtype = jnp.dtype(out_dtype or dtype)
  assert y.dtype == out_dtype
  ref = float(scale) * (_exact(x) @ _exact(w))
  rounding = BF16_U if out_dtype == jnp.bfloat16 else 2.0**-24
  # baseline's reduce-scatter sums the D scaled partial products in the
  # result's dtype (as XLA's does): D roundings, of partial sums.
  sums = D if impl == "baseline" and collective == "reduce_scatter" else 0
  bound = (rounding * np.abs(ref) + sums * rounding * np.max(np.abs(ref))
           + 1e-6 * np.max(np.abs(ref)))
  np.testing.assert_array_less(np.abs(_exact(y) - ref), bound)


def _assert_all_close(got, want, rtol=1e-5, atols=None):
  """Elementwise within rtol, plus rtol of the largest element (or the
  leaf's entry in `atols`, where given)."""
  leaves = list(zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  atols = atols or [None] * len(leaves)
  for (g, w), atol in zip(leaves, atols):
    assert g.dtype == w.dtype and g.shape == w.shape
    if atol is None:
      atol = rtol * np.max(np.abs(np.asarray(w)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol,
                               atol=atol)


def _scale_grad_atol(x, w, t):
  """The scale's gradient is sum((x @ w) * t) over every output: a sum of
  thousands of terms that cancel, so two summation orders differ by f32's
  roundoff of the sum of their magnitudes, not of the result (a seed gave
  2.8e-5 relative to the result, 7e-8 of the magnitudes). 2**-20 of the
  magnitudes: 16 roundoffs, an order above the worst of 160 draws."""
  terms = (_exact(x) @ _exact(w)) * _exact(t)
  return 2.0**-20 * np.sum(np.abs(terms))


@pytest.mark.parametrize("save_gathered", [True, False])
@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("collective", sorted(OPS))
def test_grad_of_x_w_and_the_scale_matches_xla(collective, impl,
                                               save_gathered, keys):
  mesh, x, w, scale = _operands(keys, collective, jnp.float32)
  t = normal(keys(), jax.eval_shape(_xla(collective, mesh), x, w,
                                    scale).shape, jnp.float32)
  loss = lambda f: lambda *a: jnp.sum(f(*a) * t)
  ours = loss(_ours(collective, mesh, impl, save_gathered=save_gathered))
  got = jax.jit(jax.grad(ours, (0, 1, 2)))(x, w, scale)
  want = jax.jit(jax.grad(loss(_xla(collective, mesh)), (0, 1, 2)))(
      x, w, scale)
  _assert_all_close(got, want, atols=[None, None, _scale_grad_atol(x, w, t)])
  # The scale's gradient is not the zero a non-differentiable scale gives.
  assert abs(float(got[2])) > 1e-3


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("collective", sorted(OPS))
def test_jvp_in_x_w_and_the_scale_matches_xla(collective, impl, keys):
  mesh, x, w, scale = _operands(keys, collective, jnp.float32)
  tangents = (normal(keys(), x.shape, jnp.float32),
              normal(keys(), w.shape, jnp.float32), jnp.float32(0.5))
  got = jax.jit(lambda *a: jax.jvp(_ours(collective, mesh, impl), a,
                                   tangents))(x, w, scale)
  want = jax.jvp(_xla(collective, mesh), (x, w, scale), tangents)
  _assert_all_close(got, want)
  # Only the scale's tangent: the unscaled product.
  zeros = (jnp.zeros_like(x), jnp.zeros_like(w), jnp.float32(1.0))
  _, dy = jax.jvp(_ours(collective, mesh, impl), (x, w, scale), zeros)
  _assert_all_close(dy, _xla(collective, mesh)(x, w, jnp.float32(1.0)))


@pytest.mark.parametrize("mapped", ["x", "w", "both", "scale", "all"])
@pytest.mark.parametrize("collective", sorted(OPS))
def test_vmap_of_the_scaled_op_and_its_grad_matches_xla(collective, mapped,
                                                        keys):
  mesh, x, w, scale = _operands(keys, collective, jnp.float32)
  axes = {"x": (0, None, None), "w": (None, 0, None), "both": (0, 0, None),
          "scale": (None, None, 0), "all": (0, 0, 0)}[mapped]
  args = [jnp.stack([a, 2 * a, -a]) if axis == 0 else a
          for a, axis in zip((x, w, scale), axes)]

  def value_and_grad(f):
    return jax.value_and_grad(lambda *a: jnp.sum(jnp.square(f(*a))),
                              (0, 1, 2))
  got = jax.jit(jax.vmap(value_and_grad(_ours(collective, mesh, "ring")),
                         axes))(*args)
  want = jax.vmap(value_and_grad(_xla(collective, mesh)), axes)(*args)
  _assert_all_close(got, want)


@pytest.mark.parametrize("collective", sorted(OPS))
def test_checkpoint_of_the_scaled_op_gives_the_same_gradients(collective,
                                                              keys):
  mesh, x, w, scale = _operands(keys, collective, jnp.float32)
  f = _ours(collective, mesh, "ring")
  loss = lambda g: lambda *a: jnp.sum(jnp.square(g(*a)))
  got = jax.jit(jax.grad(loss(jax.checkpoint(
      f, policy=jax.checkpoint_policies.dots_saveable)), (0, 1, 2)))(
          x, w, scale)
  want = jax.jit(jax.grad(loss(f), (0, 1, 2)))(x, w, scale)
  _assert_all_close(got, want)


@pytest.mark.parametrize("scale,match", [
    (jnp.ones((1,), jnp.float32), r"shape \(1,\)"),
    (jnp.bfloat16(2.0), "dtype bfloat16"),
])
def test_a_scale_that_is_no_f32_scalar_is_refused(scale, match, keys):
  mesh, x, w, _ = _operands(keys, "all_gather", jnp.float32)
  op = jax.shard_map(
      lambda x, w: cm.all_gather_matmul(x, w, "x", scale=scale),
      mesh=mesh, in_specs=(P("x", None), P(None, "x")),
      out_specs=P(None, "x"))
  with pytest.raises(ValueError, match=match):
    op(x, w)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_a_scale_that_varies_over_the_axis_is_refused(collective, keys):
  """The ring applies the scale to the sums it owns, the baseline and the
  kernels to each device's terms: a scale that differs across the devices
  would make them disagree. One typed as varying over the axis (shard_map's
  default check) is refused; the contract is the op's docstring."""
  mesh, x, w, _ = _operands(keys, collective, jnp.float32)
  op, in_specs, out_spec = OPS[collective]
  scales = jnp.arange(1, D + 1, dtype=jnp.float32)
  f = jax.shard_map(
      lambda x, w, s: op(x, w, "x", impl="ring", scale=s.reshape(())),
      mesh=mesh, in_specs=in_specs + (P("x"),), out_specs=out_spec)
  with pytest.raises(ValueError, match="scale varies over 'x'"):
    f(x, w, scales)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("impl", ["ring", "baseline"])
def test_the_same_scale_on_every_device_gives_ring_and_baseline_alike(
    collective, impl, keys):
  """The contract the refusal guards: one scale (replicated), the ring and
  the baseline both within one rounding of the scaled f32 product."""
  mesh, x, w, scale = _operands(keys, collective, jnp.bfloat16)
  got = _exact(_ours(collective, mesh, impl)(x, w, scale))
  want = _exact(x) @ _exact(w) * float(scale)
  np.testing.assert_allclose(got, want, rtol=2 * BF16_U,
                             atol=2 * BF16_U * np.abs(want).max())


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_a_scale_with_an_integer_result_is_refused(collective, keys):
  """Cast to an integer result, the scaled accumulation would truncate (a
  scale of 0.5 gives zeros): refused by the ops and by the drop-in, with
  the plugin on or off."""
  mesh, x, w, _ = _operands(keys, collective, jnp.float32)
  x, w = x.astype(jnp.int32), w.astype(jnp.int32)
  with pytest.raises(ValueError, match="int32 result.*truncat"):
    _ours(collective, mesh, "ring")(x, w, jnp.float32(0.5))
  dims = (((1,), (0,)), ((), ()))
  for enabled in (True, False):
    with cm.config_context(enabled=enabled), pytest.raises(
        ValueError, match="int32 result.*truncat"):
      override.collective_dot_general(x, w, dims, scale=jnp.float32(0.5))


# ------------------------------------------------ fp8_scaled_dot_general

EMBED, MLP = 64, 128


def _fp8_state(keys):
  """Scales (shape (1,), as Flax's variables) and amax histories as Flax's
  op holds them after a few steps (not 1, so the scales matter)."""
  del keys
  def history(scale):
    return jnp.zeros((16,), jnp.float32).at[1].set(scale)
  one = jnp.ones((1,), jnp.float32)
  return dict(lhs_scale=one, rhs_scale=one, grad_scale=one,
              lhs_amax_history=history(3.7), rhs_amax_history=history(0.21),
              grad_amax_history=history(5e-3))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_scaled_dot_general_is_flax_s_within_one_rounding(dtype, keys):
  """Forward: Flax rounds the fp8 product to `dtype`, then multiplies it by
  the product of the scales rounded to `dtype` (its `dequantize`) and
  rounds again; ours scales the f32 accumulation and rounds once. So ours
  is within one rounding (u: 2^-8 for bf16, 2^-24 for f32) of the exact
  scaled product, and within 4u of Flax's (its three roundings and ours).
  The gradient of x (the dgrad, scaled the same way) within 4u of Flax's
  too, relative to its largest entry; that of w (the wgrad, Flax's own
  product and dequantization) differs only by the partitioning of its sum.
  The loss is linear in the result, so both quantize the same cotangent."""
  mesh = mesh_1d(D)
  x = put(normal(keys(), (2, 4 * D, EMBED), jnp.float32).astype(dtype),
          mesh, P(None, "x", None))
  w = put(normal(keys(), (EMBED, MLP), jnp.float32).astype(dtype), mesh,
          P(None, "x"))
  t = normal(keys(), (2, 4 * D, MLP), jnp.float32)
  state = _fp8_state(keys)
  dims = (((2,), (0,)), ((), ()))

  def loss(fn):
    return lambda x, w: jnp.sum(fn(x, w, dims, preferred_element_type=dtype,
                                   **state).astype(jnp.float32) * t)

  with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
    y = jax.jit(functools.partial(
        cm.fp8_scaled_dot_general, dimension_numbers=dims,
        preferred_element_type=dtype, **state))(x, w)
    grads = jax.jit(jax.grad(loss(cm.fp8_scaled_dot_general), (0, 1)))(x, w)
  rewritten = [d for d in cm.decisions() if d.rewritten]
  assert {d.collective for d in rewritten} == {"all_gather",
                                               "reduce_scatter"}
  assert all(d.impl == "ring" for d in rewritten)
  # Flax's program on the same values, unsharded (it cannot run sharded
  # so on an Explicit mesh: both result dimensions would be on "x").
  plain = [jnp.asarray(np.asarray(a)) for a in (x, w)]
  flax_y = fp8_ops.fp8_scaled_dot_general(*plain, dims,
                                          preferred_element_type=dtype,
                                          **state)
  flax_grads = jax.grad(loss(fp8_ops.fp8_scaled_dot_general), (0, 1))(
      *plain)
  u = BF16_U if dtype == jnp.bfloat16 else 2.0**-24
  # The exact scaled products of the fp8 values Flax multiplies (first) or
  # a jitted program may (an operand rounded on the tie's other side).
  quantized_x = _quantized_both_ways(x, state["lhs_scale"],
                                     state["lhs_amax_history"])
  quantized_w = _quantized_both_ways(w, state["rhs_scale"],
                                     state["rhs_amax_history"])
  products = _exact_fp8_products("bsk,kn->bsn", quantized_x, quantized_w)
  exact = products[0]
  tiny = 1e-6 * np.max(np.abs(exact))
  np.testing.assert_array_less(_nearest(_exact(y), products),
                               u * np.abs(exact) + tiny)
  # Against Flax's result where ours multiplied Flax's fp8 values.
  same = np.abs(_exact(y) - exact) < u * np.abs(exact) + tiny
  assert same.mean() > 0.9
  np.testing.assert_array_less(np.abs(_exact(y) - _exact(flax_y))[same],
                               (4 * u * np.abs(exact) + tiny)[same])
  if dtype == jnp.bfloat16:
    # The fused scaling is what runs: it differs from Flax's somewhere.
    assert np.any(_exact(y) != _exact(flax_y))
  # An operand's element rounded on the tie's other side (above) moves the
  # gradients that multiply it by its change times the cotangent, the
  # cotangent within e5m2's rounding (2^-3) of t; zero where none did.
  (q_x, q_x_alt), s_x = quantized_x
  (q_w, q_w_alt), s_w = quantized_w
  g = 1.125 * np.abs(np.asarray(t, np.float64))
  tie_dx = np.einsum("bsn,kn->bsk", g, np.abs(q_w_alt - q_w) * s_w)
  tie_dw = np.einsum("bsk,bsn->kn", np.abs(q_x_alt - q_x) * s_x, g)
  # (+ 1e-6: f32 sums in another order, the ring's and XLA's.)
  dx, flax_dx = _exact(grads[0]), _exact(flax_grads[0])
  np.testing.assert_array_less(np.abs(dx - flax_dx),
                               (4 * u + 1e-6) * np.max(np.abs(flax_dx))
                               + tie_dx)
  # The wgrad's contraction over the rows, partitioned by XLA here and not
  # in Flax's unsharded call: ours D + 1 roundings in `dtype` at most, each
  # relative to the partial sums it adds (which can exceed the result where
  # they cancel: bounded by the sum of the shards' partial wgrads'
  # magnitudes, Flax's product on each shard's rows), and Flax's two (its
  # product, then its dequantization) relative to its result.
  dw, flax_dw = _exact(grads[1]), _exact(flax_grads[1])

  def shard_wgrad(d):
    rows = slice(4 * d, 4 * (d + 1))
    part = lambda w_: jnp.sum(fp8_ops.fp8_scaled_dot_general(
        plain[0][:, rows], w_, dims, preferred_element_type=dtype,
        **state).astype(jnp.float32) * t[:, rows])
    return _exact(jax.grad(part)(plain[1]))
  magnitude = sum(np.abs(shard_wgrad(d)) for d in range(D))
  np.testing.assert_array_less(
      np.abs(dw - flax_dw),
      ((D + 1) * np.max(magnitude) + 2 * np.max(np.abs(flax_dw))) * u
      + 1e-6 * np.max(np.abs(flax_dw)) + tie_dw)


def test_fp8_scaled_dot_general_without_preferred_element_type_is_flax_s(
    keys):
  """No `preferred_element_type`: an fp8 product, which no collective
  matmul writes (left to XLA), dequantized after into the default float,
  as Flax does."""
  # Auto sharding with logical axes: XLA's plain dot takes the matched
  # operands' shardings there (an Explicit mesh refuses them, as Flax's own
  # op on one does).
  mesh = mesh_1d(D, jax.sharding.AxisType.Auto)
  x = put(normal(keys(), (4 * D, EMBED), jnp.float32), mesh, P("x", None))
  w = put(normal(keys(), (EMBED, MLP), jnp.float32), mesh, P(None, "x"))
  state = _fp8_state(keys)
  dims = (((1,), (0,)), ((), ()))
  with jax.set_mesh(mesh), nn.logical_axis_rules((("rows", "x"),
                                                  ("mlp", "x"))), \
      cm.config_context(enabled=True, impl="ring"):
    y = jax.jit(functools.partial(
        cm.fp8_scaled_dot_general, dimension_numbers=dims,
        lhs_axes=("rows", "embed"), rhs_axes=("embed", "mlp"), **state))(
            x, w)
  (decision,) = cm.decisions()
  assert not decision.rewritten
  assert "without preferred_element_type" in decision.reason
  plain = [jnp.asarray(np.asarray(a)) for a in (x, w)]
  flax_y = fp8_ops.fp8_scaled_dot_general(*plain, dims, **state)
  assert y.dtype == flax_y.dtype
  np.testing.assert_array_equal(np.asarray(y), np.asarray(flax_y))


def test_fp8_reduce_scatter_sums_partials_rounded_to_bf16_except_the_ring(
    keys):
  """A reduce-scatter projection (the MLP's output) sums D partial
  products. The ring sums them in f32 and rounds once: within one bf16
  rounding of the exact scaled product. The baseline (and the kernel), as
  XLA in Flax's own program, round each device's partial to bf16 first, so
  an entry smaller than its partials is off by many of its own roundings
  (docs/ADVANCED.md gives the figures)."""
  mesh = mesh_1d(D)
  x = put(normal(keys(), (2, 8 * D, MLP * D), jnp.float32).astype(
      jnp.bfloat16), mesh, P(None, None, "x"))
  w = put(normal(keys(), (MLP * D, EMBED), jnp.float32).astype(
      jnp.bfloat16), mesh, P("x", None))
  state = _fp8_state(keys)
  dims = (((2,), (0,)), ((), ()))
  out_sharding = jax.sharding.NamedSharding(mesh, P(None, "x", None))
  got = {}
  with jax.set_mesh(mesh):
    for impl in ("ring", "baseline"):
      with cm.config_context(enabled=True, impl=impl):
        got[impl] = _exact(jax.jit(functools.partial(
            cm.fp8_scaled_dot_general, dimension_numbers=dims,
            preferred_element_type=jnp.bfloat16, out_sharding=out_sharding,
            **state))(x, w))
  (decision, _) = [d for d in cm.decisions() if d.rewritten]
  assert decision.collective == "reduce_scatter"
  products = _exact_fp8_products(
      "bsk,kn->bsn",
      _quantized_both_ways(x, state["lhs_scale"], state["lhs_amax_history"]),
      _quantized_both_ways(w, state["rhs_scale"], state["rhs_amax_history"]))
  exact = products[0]
  tiny = 1e-6 * np.max(np.abs(exact))
  np.testing.assert_array_less(_nearest(got["ring"], products),
                               BF16_U * np.abs(exact) + tiny)
  assert np.any(_nearest(got["baseline"], products)
                > 4 * BF16_U * np.abs(exact) + tiny)
