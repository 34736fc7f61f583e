"""A sequence-parallel MLP through the drop-in `dot_general`: both
projections rewritten, forward and backward equal to the plain program."""
import jax
from jax import lax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

import collective_matmul as cm
import cm_test_utils as utils

DENSE = (((2,), (0,)), ((), ()))


def _mlp(dot_general, x, wi, wo):
  """x[B, S@tensor, E] -> wi[E, F@tensor] (gather S) -> gelu
  -> wo[F@tensor, E] (scatter S) -> y[B, S@tensor, E]."""
  hidden = dot_general(x, wi, DENSE, out_sharding=P("data", None, "tensor"))
  return dot_general(jax.nn.gelu(hidden), wo, DENSE,
                     out_sharding=P("data", "tensor", None))


@pytest.mark.parametrize("data,tensor", [(2, 4), (4, 2), (1, 8)])
@pytest.mark.parametrize("save_gathered", [False, True])
def test_mlp_rewrites_both_projections_and_keeps_value_and_grads(
    rng, data, tensor, save_gathered):
  mesh = utils.mesh(data, tensor, AxisType.Explicit)
  batch, length, embed, mlp = 2 * data, 4 * tensor, 16, 8 * tensor
  put = lambda shape, spec, scale=1.0: jax.device_put(
      (scale * rng.standard_normal(shape)).astype(np.float32),
      NamedSharding(mesh, spec))
  with jax.set_mesh(mesh):
    x = put((batch, length, embed), P("data", "tensor", None))
    wi = put((embed, mlp), P(None, "tensor"), embed**-0.5)
    wo = put((mlp, embed), P("tensor", None), mlp**-0.5)
    cotangent = put((batch, length, embed), P("data", "tensor", None))

    def loss(dot_general, x, wi, wo):
      return jnp.sum(_mlp(dot_general, x, wi, wo) * cotangent)

    step = lambda dot_general: jax.jit(jax.value_and_grad(
        lambda *args: loss(dot_general, *args), argnums=(0, 1, 2)))
    plain_loss, plain_grads = step(lax.dot_general)(x, wi, wo)
    cm.clear_decisions()
    with cm.config_context(enabled=True, impl="ring", strict=True,
                           save_gathered=save_gathered):
      ours_loss, ours_grads = step(cm.dot_general)(x, wi, wo)
    records = cm.decisions()

  assert [(r.rewritten, r.collective, r.axis) for r in records] == [
      (True, "all_gather", "tensor"), (True, "reduce_scatter", "tensor")]
  # The loss sums x.size O(1) terms that can nearly cancel: bound the
  # difference by f32 rounding over that many terms, not by the sum.
  np.testing.assert_allclose(ours_loss, plain_loss, rtol=1e-5,
                             atol=1e-6 * x.size)
  for ours, plain, name in zip(ours_grads, plain_grads, ("x", "wi", "wo")):
    assert ours.sharding.is_equivalent_to(plain.sharding, ours.ndim), name
    utils.assert_close_to_scale(ours, utils.exact(plain), dtype="float32")
