"""patterns.match_all_gather_matmul and normalize_spec: pure, no devices."""
from jax.sharding import PartitionSpec as P
import pytest

from collective_matmul import patterns

DN = (((1,), (0,)), ((), ()))  # x[m, k] @ w[k, n]
DN3 = (((2,), (0,)), ((), ()))  # x[b, s, k] @ w[k, n]
SIZES = {"x": 4}
SIZES_2D = {"data": 2, "tensor": 4}


def match(lhs_shape, rhs_shape, dn, lhs_spec, rhs_spec, sizes, out_spec=None):
  norm = patterns.normalize_spec
  return patterns.match_all_gather_matmul(
      lhs_shape, rhs_shape, dn, norm(lhs_spec, len(lhs_shape)),
      norm(rhs_spec, len(rhs_shape)), sizes,
      None if out_spec is None else norm(
          out_spec, len(lhs_shape) + len(rhs_shape) - 2 * len(dn[0][0])))


# ------------------------------------------------------------ normalize_spec


@pytest.mark.parametrize("spec,ndim,expected", [
    (P(), 2, ((), ())),
    (None, 3, ((), (), ())),
    (P("x"), 2, (("x",), ())),
    (P(None, "x"), 2, ((), ("x",))),
    (P(("data", "tensor"), None, "x"), 3, (("data", "tensor"), (), ("x",))),
    (("a", None), 3, (("a",), (), ())),
])
def test_normalize_spec_gives_one_axis_tuple_per_dim(spec, ndim, expected):
  assert patterns.normalize_spec(spec, ndim) == expected


def test_normalize_spec_rejects_too_many_entries():
  with pytest.raises(ValueError, match="more entries"):
    patterns.normalize_spec(P("x", None, None), 2)


def test_normalize_spec_rejects_unconstrained():
  with pytest.raises(ValueError, match="unsupported spec entry"):
    patterns.normalize_spec(P(P.UNCONSTRAINED, None), 2)


@pytest.mark.parametrize("spec", [P(), P("x", None), P(None, ("a", "b")),
                                  P(("a", "b"), "c", None)])
def test_spec_to_partition_spec_roundtrips(spec):
  norm = patterns.normalize_spec(spec, 3)
  assert patterns.normalize_spec(patterns.spec_to_partition_spec(norm),
                                 3) == norm


# ---------------------------------------------------------------- positives


def test_match_2d_rows_sharded():
  m = match((16, 32), (32, 8), DN, P("x", None), P(None, "x"), SIZES)
  assert isinstance(m, patterns.AllGatherMatch)
  assert (m.axis, m.axis_size, m.lhs_gather_dim, m.rhs_out_dim) == ("x", 4,
                                                                    0, 1)
  assert m.out_spec == ((), ("x",))


def test_match_3d_seq_sharded_with_batch_on_other_axis():
  m = match((4, 16, 32), (32, 8), DN3, P("data", "tensor", None),
            P(None, "tensor"), SIZES_2D)
  assert isinstance(m, patterns.AllGatherMatch)
  assert (m.axis, m.axis_size, m.lhs_gather_dim) == ("tensor", 4, 1)
  assert m.out_spec == (("data",), (), ("tensor",))


def test_match_tuple_axes_with_collective_axis_last():
  m = match((16, 4, 32), (32, 8), DN3, P(("data", "tensor"), None, None),
            P(None, "tensor"), SIZES_2D)
  assert isinstance(m, patterns.AllGatherMatch)
  assert m.axis == "tensor" and m.lhs_gather_dim == 0
  assert m.out_spec == (("data",), (), ("tensor",))


def test_match_transposed_dimension_numbers():
  # x[k, m] contracting dim 0; w[n, k] contracting dim 1.
  m = match((32, 16), (8, 32), (((0,), (1,)), ((), ())), P(None, "x"),
            P("x", None), SIZES)
  assert isinstance(m, patterns.AllGatherMatch)
  assert (m.lhs_gather_dim, m.rhs_out_dim) == (1, 0)
  assert m.out_spec == ((), ("x",))


def test_match_accepts_out_spec_equal_to_natural_layout():
  m = match((4, 16, 32), (32, 8), DN3, P("data", "tensor", None),
            P(None, "tensor"), SIZES_2D, out_spec=P("data", None, "tensor"))
  assert isinstance(m, patterns.AllGatherMatch)


# ---------------------------------------------------------------- negatives


def _no_match(m, fallback, *reason_parts):
  assert isinstance(m, patterns.NoMatch), m
  assert m.fallback is fallback, m
  for part in reason_parts:
    assert part in m.reason, (part, m.reason)


def test_no_match_tuple_axes_with_collective_axis_first():
  m = match((16, 4, 32), (32, 8), DN3, P(("tensor", "data"), None, None),
            P(None, "tensor"), SIZES_2D)
  _no_match(m, True, "minor", "'tensor'")


def test_no_match_batch_dimension_numbers():
  m = match((2, 16, 32), (2, 32, 8), (((2,), (1,)), ((0,), (0,))),
            P(None, "x", None), P(None, None, "x"), SIZES)
  _no_match(m, False, "batch dimensions")


def test_no_match_axis_not_in_mesh():
  m = match((16, 32), (32, 8), DN, P("x", None), P(None, "model"), SIZES)
  _no_match(m, True, "'model'", "not in the mesh")


def test_no_match_lhs_rows_unsharded():
  m = match((16, 32), (32, 8), DN, P(None, None), P(None, "x"), SIZES)
  _no_match(m, False, "no mesh axis")


def test_no_match_rhs_output_unsharded():
  m = match((16, 32), (32, 8), DN, P("x", None), P(None, None), SIZES)
  _no_match(m, False, "no mesh axis")


def test_no_match_different_axes_on_rows_and_columns():
  m = match((16, 32), (32, 8), DN, P("data", None), P(None, "tensor"),
            SIZES_2D)
  _no_match(m, False, "no mesh axis")


def test_no_match_axis_of_size_one():
  m = match((16, 32), (32, 8), DN, P("x", None), P(None, "x"), {"x": 1})
  _no_match(m, False, "no mesh axis")


def test_no_match_lhs_contracting_dim_sharded():
  m = match((16, 32), (32, 8), DN, P("tensor", "data"), P(None, "tensor"),
            SIZES_2D)
  _no_match(m, True, "lhs contracting dimension 1", "'data'")


def test_no_match_rhs_contracting_dim_sharded_over_the_collective_axis():
  m = match((16, 32), (32, 8), DN, P("tensor", None), P("tensor", "tensor"),
            SIZES_2D)
  _no_match(m, True, "rhs contracting dimension 0", "'tensor'")


def test_rhs_contracting_dim_sharded_over_another_axis_is_gathered():
  # FSDP: the weight's contraction sharded over 'data' is gathered first.
  m = match((16, 32), (32, 8), DN, P("tensor", None), P("data", "tensor"),
            SIZES_2D)
  assert isinstance(m, patterns.AllGatherMatch)
  assert m.rhs_gathered == ("data",)
  assert m.rhs_spec == ((), ("tensor",))


def test_no_match_two_candidate_axes():
  m = match((16, 4, 32), (32, 8, 8), (((2,), (0,)), ((), ())),
            P("data", "tensor", None), P(None, "data", "tensor"), SIZES_2D)
  _no_match(m, True, "several mesh axes", "'data'", "'tensor'")


def test_no_match_rhs_output_sharded_over_tuple():
  m = match((16, 32), (32, 8), DN, P("tensor", None),
            P(None, ("data", "tensor")), SIZES_2D)
  _no_match(m, True, "only 'tensor' alone")


def test_no_match_rhs_second_output_dim_sharded():
  m = match((16, 32), (32, 8, 6), (((1,), (0,)), ((), ())), P("x", None),
            P(None, "x", "data"), {"x": 4, "data": 2})
  _no_match(m, True, "rhs dimension 2 is also sharded")


@pytest.mark.parametrize("lhs_shape,rhs_shape,offender", [
    ((18, 32), (32, 8), "lhs dimension 0 of size 18"),
    ((16, 32), (32, 10), "rhs dimension 1 of size 10"),
])
def test_no_match_non_divisible_shapes(lhs_shape, rhs_shape, offender):
  m = match(lhs_shape, rhs_shape, DN, P("x", None), P(None, "x"), SIZES)
  _no_match(m, True, offender, "not divisible")


def test_no_match_out_spec_keeping_rows_sharded():
  m = match((16, 32), (32, 8), DN, P("x", None), P(None, "x"), SIZES,
            out_spec=P("x", None))
  _no_match(m, False, "out_sharding")


def test_no_match_out_spec_dropping_batch_parallel_axis():
  m = match((4, 16, 32), (32, 8), DN3, P("data", "tensor", None),
            P(None, "tensor"), SIZES_2D, out_spec=P(None, None, "tensor"))
  _no_match(m, False, "out_sharding")
