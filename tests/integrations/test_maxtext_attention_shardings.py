"""`--maxtext_shard_gpu_attention`'s rule: which q/k shardings MaxText's GPU
flash attention is given, or why MaxText's own call is kept. Pure function of
the mesh and MaxText's PartitionSpecs: no MaxText needed."""
import jax
from jax.sharding import Mesh, PartitionSpec as P
import numpy as np
import pytest

from collective_matmul.integrations.maxtext import attention


@pytest.fixture(scope="module")
def mesh():
  devices = np.array(jax.devices()[:8]).reshape(2, 2, 2)
  return Mesh(devices, ("data", "context", "tensor_sequence"))


Q = (4, 128, 8, 64)  # batch, sequence, heads, head_dim (tokamax's layout)
HEADS = P("data", None, "tensor_sequence", None)


def test_batch_and_heads_are_sharded_as_maxtext_constrains_them(mesh):
  q, k, why = attention.shardings(mesh, HEADS, HEADS, Q, Q)
  assert why == ""
  assert q.spec == P("data", None, "tensor_sequence", None)
  assert k.spec == P("data", None, "tensor_sequence", None)
  assert q.mesh is mesh


def test_grouped_query_heads_shard_the_kv_heads_alike(mesh):
  q, k, why = attention.shardings(mesh, HEADS, HEADS, Q, (4, 128, 2, 64))
  assert why == "" and k.spec == P("data", None, "tensor_sequence", None)


@pytest.mark.parametrize("q_spec, k_spec, q_shape, k_shape, reason", [
    (P("data", "context", "tensor_sequence"), HEADS, Q, Q,
     "q's sequence is sharded over context (context parallelism)"),
    (HEADS, P("data", None, "tensor_sequence", "context"), Q, Q,
     "k's head_dim is sharded over context"),
    (HEADS, HEADS, (4, 128, 3, 64), Q,
     "q's 3 heads do not divide over tensor_sequence (2 devices)"),
    (HEADS, HEADS, Q, (4, 128, 1, 64),
     "k's 1 heads do not divide over tensor_sequence (2 devices)"),
    (HEADS, HEADS, (3, 128, 8, 64), (3, 128, 8, 64),
     "q's 3 batch do not divide over data (2 devices)"),
    (HEADS, P(None, None, "tensor_sequence"), Q, Q,
     "q and k batch shardings differ (data vs None)"),
    (P(), P(), Q, Q, "neither batch nor heads is sharded: nothing to split"),
    (HEADS, HEADS, (128, 8, 64), Q, "q of rank 3, k of rank 4"),
    (P("data", P.UNCONSTRAINED, "tensor_sequence"), HEADS, Q, Q,
     "unsupported spec entry"),
])
def test_what_is_not_plain_keeps_maxtexts_call(mesh, q_spec, k_spec, q_shape,
                                               k_shape, reason):
  q, k, why = attention.shardings(mesh, q_spec, k_spec, q_shape, k_shape)
  assert (q, k) == (None, None)
  assert why == reason or (reason == "unsupported spec entry" and
                           why.startswith(reason)), why


def test_a_size_one_axis_shards_nothing(mesh):
  one = Mesh(np.array(jax.devices()[:2]).reshape(1, 2),
             ("context", "tensor_sequence"))
  q, _, why = attention.shardings(one, P(None, "context", "tensor_sequence"),
                                  P(None, None, "tensor_sequence"), Q, Q)
  assert why == "" and q.spec == P(None, None, "tensor_sequence", None)


def test_off_unless_asked():
  attention.set_enabled(None)
  try:
    assert not attention.enabled()  # The flag's default, or flags unparsed.
    attention.set_enabled(True)
    assert attention.enabled()
  finally:
    attention.set_enabled(None)
