"""`--maxtext_shard_gpu_attention`: MaxText's GPU flash attention call run in
tokamax's shard_map over batch and heads.

On GPU the kernel is tokamax's Triton flash attention, which XLA cannot
partition: without shardings every device gathers q/k/v and computes every
head (measured on 2 x H200 in
benchmarks/maxtext_h200x2/llama2-sharded-attention/). Here, on CPU, tokamax's XLA attention stands in for the
kernel, through the same tokamax entry point and MaxText's own call.
"""
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from collective_matmul.integrations.maxtext import attention
from maxtext_runs import cached_train_together
from test_training import assert_losses_close, STEPS

SHARDED_NOTE = ("GPU flash attention (8, 128, 4, 64): sharded, q "
                "P('data', None, 'tensor_sequence', None)")


def _attend(plan, enabled, q, k, v, seg):
  # tokamax comes with MaxText (Python >= 3.12): imported here, so that the
  # Python 3.11 suite collects this file and skips it (conftest.py).
  from tokamax._src.ops.attention import base as tokamax_base  # pylint: disable=g-import-not-at-top
  from tokamax._src.ops.attention import jax_nn  # pylint: disable=g-import-not-at-top
  attention.set_enabled(enabled)
  attention._local.plan = plan  # pylint: disable=protected-access
  try:
    mask = tokamax_base.Mask(is_causal=True) & tokamax_base.Mask(
        (seg[:, :, None] == seg[:, None, :])[:, None])
    op = attention._ShardedOp(  # pylint: disable=protected-access
        jax_nn.JaxNnDotProductAttention(implementation="xla"))
    return op(q, k, v, logits_scale=1.0, mask=mask)
  finally:
    attention._local.plan = None  # pylint: disable=protected-access
    attention.set_enabled(None)


def test_the_op_runs_in_a_shard_map_with_the_same_values_and_gradients():
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2),
              ("data", "tensor_sequence"))
  spec = P("data", None, "tensor_sequence", None)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(key, (4, 64, 8, 32), jnp.float32)
             for key in keys)
  seg = jnp.concatenate([jnp.ones((4, 40), jnp.int32),
                         2 * jnp.ones((4, 24), jnp.int32)], axis=1)
  plan = attention.shardings(mesh, spec, spec, q.shape, k.shape)
  assert plan[0] is not None, plan

  def loss(enabled, q, k, v):
    return jnp.sum(_attend(plan, enabled, q, k, v, seg) ** 2)

  jaxprs = {on: str(jax.make_jaxpr(lambda *a: loss(on, *a))(q, k, v))
            for on in (False, True)}
  assert "shard_map" in jaxprs[True]
  assert "tensor_sequence" in jaxprs[True]
  assert "shard_map" not in jaxprs[False]
  sharding = NamedSharding(mesh, spec)
  q, k, v = (jax.device_put(x, sharding) for x in (q, k, v))
  results = {on: jax.jit(jax.value_and_grad(
      lambda *a, on=on: loss(on, *a), argnums=(0, 1, 2)))(q, k, v)
             for on in (False, True)}
  np.testing.assert_allclose(results[True][0], results[False][0], rtol=1e-6)
  for on, off in zip(results[True][1], results[False][1]):
    # f32 sums in another order: close relative to the gradient's scale.
    np.testing.assert_allclose(on, off, rtol=0,
                               atol=1e-5 * float(jnp.max(jnp.abs(off))))


def _runs():
  common = dict(model="llama2-7b", mesh="ts4_data2", dtype="f32",
                xla_flash_attention=True)
  return cached_train_together(
      ("flash-off", dict(steps=STEPS, plugin=(), **common)),
      ("flash-sharded", dict(steps=STEPS,
                             plugin=("--maxtext_shard_gpu_attention",),
                             **common)),
      ("flash-sharded-ring", dict(steps=STEPS, plugin=(
          "--maxtext_shard_gpu_attention", "--use_collective_matmul",
          "--collective_matmul_impl=ring"), **common)))


def test_maxtext_trains_to_the_same_losses_with_the_attention_sharded():
  off, on, ring = _runs()
  assert_losses_close(on, off, 1e-5)
  assert_losses_close(ring, off, 1e-5)


def test_the_launcher_says_what_it_did_with_each_flash_attention_call():
  off, on, ring = _runs()
  for run_ in (on, ring):
    assert SHARDED_NOTE in run_.stdout, run_.stdout[-3000:]
    assert "sharded GPU flash attention on" in run_.stdout
  assert SHARDED_NOTE not in off.stdout
  assert ("every device computes every head (MaxText calls the kernel with "
          "no sharding" in off.stdout), off.stdout[-3000:]


def test_shardings_that_cannot_be_read_keep_maxtexts_call(monkeypatch):
  from maxtext.layers import attention_op  # pylint: disable=g-import-not-at-top
  plans = []

  def maxtext_apply_attention(self, query, key, value, decoder_segment_ids,
                              **kwargs):
    del self, query, key, value, decoder_segment_ids, kwargs
    plans.append(attention._local.plan)  # pylint: disable=protected-access
    return "maxtext's result"

  class BrokenRules:
    attention_kernel = "flash"

    def _logical_to_mesh_axes(self, names):
      raise KeyError(names)

  attention.uninstall()
  monkeypatch.setattr(attention_op.AttentionOp, "apply_attention",
                      maxtext_apply_attention)
  attention.install()  # Wraps the stand-in above.
  attention.set_enabled(True)
  try:
    q = jnp.zeros((2, 8, 4, 16))
    result = attention_op.AttentionOp.apply_attention(
        BrokenRules(), q, q, q, None, model_mode="train")
  finally:
    attention.set_enabled(None)
    attention.uninstall()
  assert result == "maxtext's result"
  assert plans[0][0] is None and "could not be read" in plans[0][2], plans
