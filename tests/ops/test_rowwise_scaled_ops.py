"""The ops' `row_scale` / `col_scale` (rowwise fp8: one scale per row of the
activation, one per column of the weight): entry [i, j] of the f32
accumulation times row_scale[i] * col_scale[j], then the cast (`ring` and
`baseline`, the executable spec of the kernels' epilogue), against a
float64 reference; `grad` (x and w scaled, the scales constants of
differentiation, as Qwix's), `jvp`, `vmap` and `checkpoint` against the same
program written with XLA's collectives; and the inputs that are refused."""
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import collective_matmul as cm
from collective_matmul import override
from cm_test_utils import mesh_1d, normal

D, M, K, N = 4, 8, 64, 16
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16_U = 2.0**-8  # bf16's unit roundoff: one rounding of a result.
# op, specs of (x, w, row_scale, col_scale), the result's spec. The
# all-gather's scales are local (rows of the local x, columns of the local
# w); the reduce-scatter's are every device's (all rows, all columns).
OPS = {"all_gather": (cm.all_gather_matmul,
                      (P("x", None), P(None, "x"), P("x"), P("x")),
                      P(None, "x")),
       "reduce_scatter": (cm.matmul_reduce_scatter,
                          (P(None, "x"), P("x", None), P(), P()),
                          P("x", None))}


def _exact(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _scales(keys, shape):
  return jax.random.uniform(keys(), shape, jnp.float32, 0.25, 4.0)


def _operands(keys, collective, dtype=jnp.float32, rhs_dtype=None):
  mesh = mesh_1d(D, jax.sharding.AxisType.Auto)
  if collective == "all_gather":
    x_shape, w_shape = (D * M, K), (K, D * N)
  else:
    x_shape, w_shape = (D * M, D * K), (D * K, N)
  x = normal(keys(), x_shape, jnp.float32).astype(dtype)
  w = normal(keys(), w_shape, jnp.float32).astype(rhs_dtype or dtype)
  return mesh, x, w, _scales(keys, x_shape[:1]), _scales(keys, w_shape[1:])


def _ours(collective, mesh, impl="ring", **kwargs):
  """f(x, w, row_scale, col_scale): the op over the whole mesh."""
  op, in_specs, out_spec = OPS[collective]
  return jax.shard_map(
      lambda x, w, r, c: op(x, w, "x", impl=impl, row_scale=r, col_scale=c,
                            **kwargs),
      mesh=mesh, in_specs=in_specs, out_specs=out_spec)


def _xla(collective, mesh, preferred_element_type=None):
  """The same product written with XLA's collectives, the scales
  stop_gradient'ed: the f32 accumulation times row[i] * col[j], cast."""
  _, in_specs, out_spec = OPS[collective]

  def body(x, w, r, c):
    r, c = lax.stop_gradient(r), lax.stop_gradient(c)
    if collective == "all_gather":
      x = lax.all_gather(x, "x", tiled=True)
      r = lax.all_gather(r, "x", tiled=True)
    acc = lax.dot(x, w, preferred_element_type=jnp.float32)
    acc = acc * r[:, None] * c
    if collective == "reduce_scatter":
      acc = lax.psum_scatter(acc, "x", tiled=True)
    return acc.astype(preferred_element_type or x.dtype)
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                       out_specs=out_spec)


def _reference(x, w, r, c):
  return _exact(r)[:, None] * (_exact(x) @ _exact(w)) * _exact(c)


def _assert_all_close(got, want, rtol=1e-5):
  """Elementwise within rtol, plus rtol of the leaf's largest element."""
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol,
                               atol=rtol * np.max(np.abs(np.asarray(w))))


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("collective", sorted(OPS))
@pytest.mark.parametrize("dtype,rhs_dtype,out_dtype", [
    (jnp.float32, None, None), (jnp.bfloat16, None, None),
    (E4M3, None, jnp.bfloat16), (E4M3, None, jnp.float32),
    (E5M2, E5M2, jnp.float32), (E5M2, E4M3, jnp.float32)],
    ids=["f32", "bf16", "e4m3_bf16", "e4m3_f32", "e5m2_f32", "e5m2_e4m3_f32"])
def test_rowwise_ops_are_the_scaled_accumulation_rounded_once(
    impl, collective, dtype, rhs_dtype, out_dtype, keys):
  mesh, x, w, r, c = _operands(keys, collective, dtype, rhs_dtype)
  y = jax.jit(_ours(collective, mesh, impl,
                    preferred_element_type=out_dtype))(x, w, r, c)
  out_dtype = jnp.dtype(out_dtype or dtype)
  assert y.dtype == out_dtype
  ref = _reference(x, w, r, c)
  rounding = BF16_U if out_dtype == jnp.bfloat16 else 2.0**-24
  # baseline's reduce-scatter sums the D scaled partial products in the
  # result's dtype (as XLA's does): D roundings, of partial sums.
  sums = D if impl == "baseline" and collective == "reduce_scatter" else 0
  bound = (rounding * np.abs(ref) + sums * rounding * np.max(np.abs(ref))
           + 1e-6 * np.max(np.abs(ref)))
  np.testing.assert_array_less(np.abs(_exact(y) - ref), bound)


@pytest.mark.parametrize("collective", sorted(OPS))
def test_dropping_the_scales_changes_the_product(collective, keys):
  """The positive control of the comparisons here: the unscaled product is
  far from the reference."""
  mesh, x, w, r, c = _operands(keys, collective)
  ref = _reference(x, w, r, c)
  op, in_specs, out_spec = OPS[collective]
  unscaled = jax.shard_map(lambda x, w: op(x, w, "x", impl="ring"),
                           mesh=mesh, in_specs=in_specs[:2],
                           out_specs=out_spec)(x, w)
  assert np.max(np.abs(_exact(unscaled) - ref)) > 0.1 * np.max(np.abs(ref))


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("collective", sorted(OPS))
@pytest.mark.parametrize("given", ["row", "col", "row_and_scale"])
def test_each_scale_alone_or_with_the_scalar_scale_multiplies_its_own(
    given, collective, impl, keys):
  """A row-scaled operand with a per-tensor weight scale (`row_scale` and
  `scale`), or one vector alone: the accumulation times what is given."""
  mesh, x, w, r, c = _operands(keys, collective)
  scale = jnp.float32(0.75)
  op, in_specs, out_spec = OPS[collective]
  kwargs, specs, args = {
      "row": (lambda r: {"row_scale": r}, in_specs[2], r),
      "col": (lambda c: {"col_scale": c}, in_specs[3], c),
      "row_and_scale": (lambda r: {"row_scale": r, "scale": scale},
                        in_specs[2], r)}[given]
  y = jax.shard_map(lambda x, w, s: op(x, w, "x", impl=impl, **kwargs(s)),
                    mesh=mesh, in_specs=in_specs[:2] + (specs,),
                    out_specs=out_spec)(x, w, args)
  ref = _exact(x) @ _exact(w)
  ref = {"row": _exact(r)[:, None] * ref, "col": ref * _exact(c),
         "row_and_scale": 0.75 * _exact(r)[:, None] * ref}[given]
  np.testing.assert_allclose(_exact(y), ref, rtol=1e-5,
                             atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("collective", sorted(OPS))
def test_rows_split_on_a_later_dimension_take_their_scales(collective,
                                                           keys):
  """x[b, s, k] gathered (or scattered) on s: `row_scale` is [b, s]."""
  mesh = mesh_1d(D, jax.sharding.AxisType.Auto)
  b, s = 2, D * 4
  k, n = (K, D * N) if collective == "all_gather" else (D * K, N)
  x = normal(keys(), (b, s, k), jnp.float32)
  w = normal(keys(), (k, n), jnp.float32)
  r, c = _scales(keys, (b, s)), _scales(keys, (n,))
  op = OPS[collective][0]
  if collective == "all_gather":
    specs = (P(None, "x", None), P(None, "x"), P(None, "x"), P("x"))
    out_spec = P(None, None, "x")
  else:
    specs = (P(None, None, "x"), P("x", None), P(), P())
    out_spec = P(None, "x", None)
  axis = "gather_axis" if collective == "all_gather" else "scatter_axis"
  y = jax.jit(jax.shard_map(
      lambda x, w, r, c: op(x, w, "x", row_scale=r, col_scale=c,
                            **{axis: 1}),
      mesh=mesh, in_specs=specs, out_specs=out_spec))(x, w, r, c)
  ref = _exact(r)[..., None] * (_exact(x) @ _exact(w)) * _exact(c)
  np.testing.assert_allclose(_exact(y), ref, rtol=1e-5,
                             atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("save_gathered", [True, False])
@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("collective", sorted(OPS))
def test_grad_of_x_and_w_matches_xla_and_the_scales_get_zero(
    collective, impl, save_gathered, keys):
  mesh, x, w, r, c = _operands(keys, collective)
  t = normal(keys(), jax.eval_shape(_xla(collective, mesh), x, w, r,
                                    c).shape, jnp.float32)
  loss = lambda f: lambda *a: jnp.sum(f(*a) * t)
  ours = loss(_ours(collective, mesh, impl, save_gathered=save_gathered))
  got = jax.jit(jax.grad(ours, (0, 1, 2, 3)))(x, w, r, c)
  want = jax.jit(jax.grad(loss(_xla(collective, mesh)), (0, 1, 2, 3)))(
      x, w, r, c)
  _assert_all_close(got, want)
  assert not np.any(np.asarray(got[2])) and not np.any(np.asarray(got[3]))
  # The positive control: the unscaled op's gradient of x differs.
  unscaled = jax.grad(loss(_xla(collective, mesh)))(
      x, w, jnp.ones_like(r), jnp.ones_like(c))
  assert np.max(np.abs(np.asarray(unscaled - got[0]))) > 0.1 * np.max(
      np.abs(np.asarray(got[0])))


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("collective", sorted(OPS))
def test_jvp_in_x_and_w_matches_xla_the_scales_tangents_dropped(
    collective, impl, keys):
  mesh, x, w, r, c = _operands(keys, collective)
  tangents = (normal(keys(), x.shape, jnp.float32),
              normal(keys(), w.shape, jnp.float32),
              jnp.ones_like(r), jnp.ones_like(c))
  got = jax.jit(lambda *a: jax.jvp(_ours(collective, mesh, impl), a,
                                   tangents))(x, w, r, c)
  want = jax.jvp(_xla(collective, mesh), (x, w, r, c), tangents)
  _assert_all_close(got, want)


@pytest.mark.parametrize("mapped", ["x", "rows", "x_rows", "w", "cols",
                                    "w_cols", "all"])
@pytest.mark.parametrize("collective", sorted(OPS))
def test_vmap_of_the_rowwise_op_and_its_grad_matches_xla(collective, mapped,
                                                         keys):
  mesh, x, w, r, c = _operands(keys, collective)
  axes = {"x": (0, None, None, None), "rows": (None, None, 0, None),
          "x_rows": (0, None, 0, None), "w": (None, 0, None, None),
          "cols": (None, None, None, 0), "w_cols": (None, 0, None, 0),
          "all": (0, 0, 0, 0)}[mapped]
  args = [jnp.stack([a, 2 * a, 0.5 * a]) if axis == 0 else a
          for a, axis in zip((x, w, r, c), axes)]

  def value_and_grad(f):
    return jax.value_and_grad(lambda *a: jnp.sum(jnp.square(f(*a))), (0, 1))
  got = jax.jit(jax.vmap(value_and_grad(_ours(collective, mesh)),
                         axes))(*args)
  want = jax.vmap(value_and_grad(_xla(collective, mesh)), axes)(*args)
  _assert_all_close(got, want)


@pytest.mark.parametrize("policy", ["dots_saveable", "nothing_saveable"])
@pytest.mark.parametrize("collective", sorted(OPS))
def test_checkpoint_of_the_rowwise_op_gives_xla_s_gradients(collective,
                                                            policy, keys):
  mesh, x, w, r, c = _operands(keys, collective)
  remat = jax.checkpoint(_ours(collective, mesh),
                         policy=getattr(jax.checkpoint_policies, policy))
  square_sum = lambda f: lambda *a: jnp.sum(jnp.square(f(*a)))
  _assert_all_close(
      jax.jit(jax.grad(square_sum(remat), (0, 1)))(x, w, r, c),
      jax.grad(square_sum(_xla(collective, mesh)), (0, 1))(x, w, r, c))


# ------------------------------------------------------------- bad input


def _call(collective, mesh, x, w, r, c, impl="ring", specs=None, **kwargs):
  op, in_specs, out_spec = OPS[collective]
  return jax.shard_map(
      lambda x, w, r, c: op(x, w, "x", impl=impl, row_scale=r, col_scale=c,
                            **kwargs),
      mesh=mesh, in_specs=specs or in_specs, out_specs=out_spec)(x, w, r, c)


@pytest.mark.parametrize("collective", sorted(OPS))
@pytest.mark.parametrize("bad,match", [
    ("row_length", r"row_scale of shape \(\d+,\) .*expected float32 of "
                   r"shape \(8,\)"),
    ("col_length", r"col_scale of shape \(\d+,\) .*expected float32 of "
                   r"shape \(\d+,\)"),
    ("row_dtype", "row_scale of shape .* and dtype bfloat16"),
    ("col_dtype", "col_scale of shape .* and dtype float16"),
    ("row_rank", r"row_scale of shape \(\d+, 1\)")])
def test_scales_of_the_wrong_shape_or_dtype_are_refused(collective, bad,
                                                        match, keys):
  mesh, x, w, r, c = _operands(keys, collective)
  if collective == "reduce_scatter":
    match = match.replace(r"\(8,\)", r"\(32,\)")
  if bad == "row_length":
    r = jnp.concatenate([r, r])
  elif bad == "col_length":
    c = jnp.concatenate([c, c])
  elif bad == "row_dtype":
    r = r.astype(jnp.bfloat16)
  elif bad == "col_dtype":
    c = c.astype(jnp.float16)
  specs = None
  if bad == "row_rank":
    r = r[:, None]
    specs = OPS[collective][1][:2] + (P(*OPS[collective][1][2], None),
                                      OPS[collective][1][3])
  with pytest.raises(ValueError, match=match):
    _call(collective, mesh, x, w, r, c, specs=specs)


@pytest.mark.parametrize("which", ["row_scale", "col_scale"])
def test_reduce_scatter_scales_that_vary_over_the_axis_are_refused(which,
                                                                   keys):
  """Every device scales its partial product of the same rows and columns:
  scales that differ across the devices would make the ring and the
  baseline disagree. Ones typed as varying over the axis are refused."""
  mesh, x, w, r, c = _operands(keys, "reduce_scatter")
  specs = list(OPS["reduce_scatter"][1])
  if which == "row_scale":
    r, specs[2] = jnp.tile(r, D), P("x")
  else:
    c, specs[3] = jnp.tile(c, D), P("x")
  with pytest.raises(ValueError, match=f"{which} varies over 'x'"):
    _call("reduce_scatter", mesh, x, w, r, c, specs=tuple(specs))


@pytest.mark.parametrize("collective", sorted(OPS))
def test_rowwise_scales_with_an_integer_result_are_refused(collective, keys):
  mesh, x, w, r, c = _operands(keys, collective)
  x, w = x.astype(jnp.int32), w.astype(jnp.int32)
  with pytest.raises(ValueError, match="row_scale with a int32 result"):
    _call(collective, mesh, x, w, r, c)


@pytest.mark.parametrize("impl", ["ring", "baseline"])
@pytest.mark.parametrize("collective", sorted(OPS))
def test_zero_negative_and_nan_scales_act_on_their_row_or_column_only(
    collective, impl, keys):
  """The documented result (values are not checked, they are traced): a
  zero scale zeroes its row, a negative one flips its column's sign, a
  NaN makes its row NaN; every other entry is the scaled product."""
  mesh, x, w, r, c = _operands(keys, collective)
  r = r.at[1].set(0.0).at[2].set(jnp.nan)
  c = c.at[3].set(-c[3])
  y = _exact(_call(collective, mesh, x, w, r, c, impl=impl))
  ref = _reference(x, w, r, c)
  assert np.all(y[1] == 0) and np.all(np.isnan(y[2]))
  assert np.sum(np.isnan(y)) == y.shape[1]
  finite = ~np.isnan(ref)
  np.testing.assert_allclose(y[finite], ref[finite], rtol=1e-5,
                             atol=1e-5 * np.abs(ref[finite]).max())



# ------------------------------------------------------------- the drop-in

DIMS = (((2,), (0,)), ((), ()))


@pytest.mark.parametrize("enabled", [True, False])
def test_the_drop_in_refuses_rowwise_scales_with_an_integer_result(enabled,
                                                                   keys):
  x = jnp.ones((2, 8, 4), jnp.int32)
  w = jnp.ones((4, 6), jnp.int32)
  with cm.config_context(enabled=enabled), pytest.raises(
      ValueError, match="col_scale with a int32 result.*truncat"):
    override.collective_dot_general(x, w, DIMS,
                                    col_scale=_scales(keys, (6,)))


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("bad,match", [
    ("row", r"row_scale of shape \(2, 9\) .* shape \(2, 8\) \(one per row "
            r"of the product of lhs\(2, 8, 4\)"),
    ("col", r"col_scale of shape \(6,\) and dtype bfloat16"),
    ("batch", "row_scale / col_scale with batch dimensions")])
def test_the_drop_in_refuses_scales_that_are_not_the_product_s(
    enabled, bad, match, keys):
  x = normal(keys(), (2, 8, 4), jnp.float32)
  w = normal(keys(), (4, 6), jnp.float32)
  row, col, dims = _scales(keys, (2, 8)), _scales(keys, (6,)), DIMS
  if bad == "row":
    row = _scales(keys, (2, 9))
  elif bad == "col":
    col = col.astype(jnp.bfloat16)
  else:
    x, w = x[None], jnp.broadcast_to(w, (1, 4, 6))
    dims, row, col = (((3,), (1,)), ((0,), (0,))), row[None], col[None]
  with cm.config_context(enabled=enabled), pytest.raises(ValueError,
                                                         match=match):
    override.collective_dot_general(x, w, dims, row_scale=row,
                                    col_scale=col)


def test_the_drop_in_left_to_xla_scales_the_product_as_qwix_does(keys):
  """Plugin off (and a call it leaves to XLA): `lax.dot_general`'s result
  times the row scales over the lhs's free dimensions and the column
  scales over the rhs's."""
  x = normal(keys(), (2, 8, 4), jnp.float32)
  w = normal(keys(), (4, 3, 2), jnp.float32)
  row, col = _scales(keys, (2, 8)), _scales(keys, (3, 2))
  got = override.collective_dot_general(x, w, DIMS, row_scale=row,
                                        col_scale=col)
  want = (np.einsum("bsk,khd->bshd", _exact(x), _exact(w))
          * _exact(row)[..., None, None] * _exact(col))
  np.testing.assert_allclose(_exact(got), want, rtol=1e-5,
                             atol=1e-5 * np.abs(want).max())
