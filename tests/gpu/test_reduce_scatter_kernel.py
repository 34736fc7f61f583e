"""The Hopper matmul-reduce-scatter kernel against an f32 reference."""
import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from collective_matmul import kernels

from gpu_env import HOPPER_COUNT
from gpu_env import all_gather_kernel
from gpu_env import reduce_scatter_kernel
from gpu_env import poison as _poison
from gpu_env import rel_error as _rel
from gpu_env import ring_mesh as _mesh


def _run(fn, a, b):
  return jax.jit(jax.shard_map(fn, out_specs=P("x", None),
                               check_vma=False))(a, b)


@pytest.mark.parametrize("d", [1, 2, 4])
@pytest.mark.parametrize("m,k,n", [(1024, 4096, 4096), (256, 1024, 512),
                                   (200, 512, 384)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_reduce_scatter_kernel_matches_reference_and_nccl(d, m, k, n, dtype):
  if d > HOPPER_COUNT:
    pytest.skip(f"needs {d} GPUs")
  key = jax.random.key(m + n + d)
  with jax.set_mesh(_mesh(d)):
    a = jax.sharding.reshard(jax.random.normal(
        key, (d * m, d * k), dtype), P(None, "x"))
    b = jax.sharding.reshard(jax.random.normal(
        jax.random.fold_in(key, 1), (d * k, n), dtype), P("x", None))
    ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    first = None
    for _ in range(3):  # A result that changes between runs is a race.
      _poison(d * m * n * 4)
      out = np.asarray(_run(functools.partial(
          reduce_scatter_kernel, axis_name="x"), a, b), np.float32)
      assert out.shape == (d * m, n)
      assert _rel(out, ref) < 1e-2
      if first is None:
        first = out
      np.testing.assert_array_equal(out, first)
    nccl = _run(lambda x, y: lax.psum_scatter(
        x @ y, "x", scatter_dimension=0, tiled=True), a, b)
    assert _rel(out, np.asarray(nccl, np.float32)) < 1e-2


# Announce inside the k loop (k = 3200: 2 steps before its end) or after it
# (k = 1536, and the unpaced variant); a one-step k loop (k = 64).
@pytest.mark.parametrize("config,k", [
    (None, 3200), (None, 1536), (None, 64),
    (kernels.ReduceScatterConfig(spread_sends=False, send_gap=2), 1024),
    (kernels.ReduceScatterConfig(epi_tile_n=128, max_concurrent_steps=3,
                                 send_pieces=4, send_gap=3), 1024),
    (kernels.ReduceScatterConfig(chain_tiles=True), 1024),
    (kernels.ReduceScatterConfig(tile_n=64, send_pieces=4, send_gap=6,
                                 chain_tiles=True), 4096),
    # 3 stages chained: 16 and 1 k steps, no multiple of 3 (`_OffsetChain`).
    (kernels.ReduceScatterConfig(epi_tile_n=128, max_concurrent_steps=3,
                                 send_pieces=2, chain_tiles=True), 1024),
    (kernels.ReduceScatterConfig(epi_tile_n=128, max_concurrent_steps=3,
                                 send_pieces=2, chain_tiles=True), 64),
    # 64 x 256 warpgroup tiles: wrong until run 49 (a wgmma still read a
    # freed slot).
    (kernels.ReduceScatterConfig(tile_m=64, tile_n=256, wg_dimension="m"),
     1024)],
    ids=["early", "late", "one_k_step", "unpaced", "pieces",
         "chained", "chained_small_tiles", "chained_3_stages",
         "chained_3_stages_one_k_step", "wide_warpgroup_tiles"])
def test_reduce_scatter_schedules_are_exact_and_repeatable(config, k):
  """On 2 GPUs the ring; on one, the same kernel's core (no ring)."""
  d, m, n = min(2, HOPPER_COUNT), 512, 768
  with jax.set_mesh(_mesh(d)):
    a = jax.sharding.reshard(jax.random.normal(
        jax.random.key(k), (d * m, d * k), jnp.bfloat16), P(None, "x"))
    b = jax.sharding.reshard(jax.random.normal(
        jax.random.key(k + 1), (d * k, n), jnp.bfloat16), P("x", None))
    ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    f = functools.partial(reduce_scatter_kernel, axis_name="x",
                          config=config)
    _poison(d * m * n * 4)
    first = np.asarray(_run(f, a, b), np.float32)
    assert _rel(first, ref) < 1e-2
    _poison(d * m * n * 4)
    np.testing.assert_array_equal(np.asarray(_run(f, a, b), np.float32),
                                  first)


@pytest.mark.skipif(HOPPER_COUNT < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("batch,seq", [(4, 256), (2, 512)])
def test_all_gather_kernel_writes_batch_major_rows(batch, seq):
  """rows_per_batch: [b, s] rows gathered on s land as [b, D * s]."""
  d, k, n = 2, 512, 512
  with jax.set_mesh(_mesh(d)):
    x = jax.sharding.reshard(jax.random.normal(
        jax.random.key(9), (batch, d * seq, k), jnp.bfloat16),
        P(None, "x", None))
    w = jax.sharding.reshard(jax.random.normal(
        jax.random.key(10), (k, d * n), jnp.bfloat16), P(None, "x"))

    def body(xb, wb):
      flat = xb.reshape(-1, k)
      out = all_gather_kernel(flat, wb, "x", rows_per_batch=seq)
      return out.reshape(batch, d * seq, wb.shape[1])

    _poison(batch * d * seq * n * 4)
    out = jax.jit(jax.shard_map(body, out_specs=P(None, None, "x"),
                                check_vma=False))(x, w)
    ref = np.einsum("bsk,kn->bsn", np.asarray(x, np.float32),
                    np.asarray(w, np.float32))
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("m", [512, 300])
def test_all_gather_kernel_returns_the_gathered_shards(m):
  d = min(2, HOPPER_COUNT)
  k, n = 512, 512
  with jax.set_mesh(_mesh(d)):
    a = jax.sharding.reshard(jax.random.normal(
        jax.random.key(11), (d * m, k), jnp.bfloat16), P("x", None))
    b = jax.sharding.reshard(jax.random.normal(
        jax.random.key(12), (k, d * n), jnp.bfloat16), P(None, "x"))

    def body(xb, wb):
      out, held = all_gather_kernel(xb, wb, "x", return_gathered=True)
      expected = lax.all_gather(xb, "x", axis=0, tiled=False)
      mismatch = jnp.sum(held != expected)
      return out, mismatch[None]

    out, mismatch = jax.jit(jax.shard_map(
        body, out_specs=(P(None, "x"), P("x")), check_vma=False))(a, b)
    assert int(np.asarray(mismatch).sum()) == 0
    ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    assert _rel(out, ref) < 1e-2


@pytest.mark.skipif(HOPPER_COUNT < 2, reason="needs 2 GPUs")
def test_reduce_scatter_kernel_reads_batch_major_rows():
  """rows_per_batch: x[b, D * s, k] scattered on s, no transposes."""
  d, batch, seq, k, n = 2, 3, 256, 512, 512
  with jax.set_mesh(_mesh(d)):
    x = jax.sharding.reshard(jax.random.normal(
        jax.random.key(13), (batch, d * seq, d * k), jnp.bfloat16),
        P(None, None, "x"))
    w = jax.sharding.reshard(jax.random.normal(
        jax.random.key(14), (d * k, n), jnp.bfloat16), P("x", None))

    def body(xb, wb):
      out = reduce_scatter_kernel(xb.reshape(-1, xb.shape[-1]), wb, "x",
                                  rows_per_batch=seq)
      return out.reshape(batch, seq, n)

    _poison(batch * d * seq * n * 4)
    out = jax.jit(jax.shard_map(body, out_specs=P(None, "x", None),
                                check_vma=False))(x, w)
    ref = np.einsum("bsk,kn->bsn", np.asarray(x, np.float32),
                    np.asarray(w, np.float32))
    assert _rel(out, ref) < 1e-2


# (data, tensor): a 2-GPU ring, and a 2 x 2 mesh whose rings run on the
# tensor axis with the batch on the data axis (peers addressed per axis).
@pytest.mark.parametrize("data,d", [(1, 2), (2, 2)], ids=["1x2", "2x2"])
@pytest.mark.parametrize("save_gathered", [False, True])
def test_pallas_ops_gradients_match_baseline(save_gathered, data, d):
  """Both collective ops through impl=pallas, forward and backward."""
  import collective_matmul as cm
  if data * d > HOPPER_COUNT:
    pytest.skip(f"needs {data * d} GPUs")
  batch, seq, e, f = 2 * data, 256, 512, 1024
  with jax.set_mesh(_mesh(d, data=data)):
    x = jax.sharding.reshard(jax.random.normal(
        jax.random.key(15), (batch, d * seq, e), jnp.bfloat16),
        P("data", "x", None))
    wi = jax.sharding.reshard(jax.random.normal(
        jax.random.key(16), (e, d * f), jnp.bfloat16) * e ** -0.5,
        P(None, "x"))
    wo = jax.sharding.reshard(jax.random.normal(
        jax.random.key(17), (d * f, e), jnp.bfloat16) * f ** -0.5,
        P("x", None))

    def mlp(impl):
      def body(xb, wib, wob):
        h = cm.all_gather_matmul(xb, wib, "x", gather_axis=1, impl=impl,
                                 save_gathered=save_gathered)
        h = jax.nn.gelu(h)
        return cm.matmul_reduce_scatter(h, wob, "x", scatter_axis=1,
                                        impl=impl,
                                        save_gathered=save_gathered)
      f = jax.shard_map(body, out_specs=P("data", "x", None),
                        check_vma=False)
      loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    got_loss, got = mlp("pallas")(x, wi, wo)
    ref_loss, ref = mlp("baseline")(x, wi, wo)
    assert abs(float(got_loss) - float(ref_loss)) <= 2e-2 * abs(float(ref_loss))
    for g, r in zip(got, ref):
      assert _rel(g, np.asarray(r, np.float32)) < 3e-2
