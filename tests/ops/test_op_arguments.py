"""Both collective ops check their arguments the same way, before tracing
anything, and name the offending one."""
import jax.numpy as jnp
import pytest

from collective_matmul import ops

OPS = {"all_gather": (ops.all_gather_matmul, "gather_axis"),
       "reduce_scatter": (ops.matmul_reduce_scatter, "scatter_axis")}


@pytest.mark.parametrize("collective", sorted(OPS))
@pytest.mark.parametrize("bad,match", [
    (lambda axis_arg: {"impl": "cuda"},
     "impl='cuda' is not one of \\('pallas', 'ring', 'baseline'\\)"),
    (lambda axis_arg: {axis_arg: 1},
     "{axis_arg}=1 must index one of the 1 leading dimensions of x\\(4, 8\\)"),
])
def test_bad_arguments_are_rejected_by_name(collective, bad, match):
  op, axis_arg = OPS[collective]
  with pytest.raises(ValueError, match=match.format(axis_arg=axis_arg)):
    op(jnp.zeros((4, 8)), jnp.zeros((8, 2)), "x", **bad(axis_arg))


@pytest.mark.parametrize("collective", sorted(OPS))
def test_contraction_mismatch_is_rejected(collective):
  op, _ = OPS[collective]
  with pytest.raises(ValueError, match="contraction sizes differ: x\\(4, 8\\) "
                     "has k=8, w\\(16, 2\\) has k=16"):
    op(jnp.zeros((4, 8)), jnp.zeros((16, 2)), "x")


@pytest.mark.parametrize("collective", sorted(OPS))
def test_a_one_dimensional_activation_is_rejected(collective):
  op, _ = OPS[collective]
  with pytest.raises(ValueError, match="expected x\\[..., k\\] with ndim >= 2"):
    op(jnp.zeros((8,)), jnp.zeros((8, 2)), "x")
