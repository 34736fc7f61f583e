"""bench_kernels.Timer: every method timed again, round-robin, median kept."""
import argparse

from cm_test_utils import import_script


def _bench_kernels():
  return import_script("bench_kernels")


def test_rounds_are_round_robin_and_the_median_is_reported(monkeypatch):
  bench = _bench_kernels()
  calls = []
  times = {"a": iter([10.0, 30.0, 20.0]), "b": iter([5.0, 1.0, 3.0])}

  def fake_kernel_time_us(f, *operands, iterations):
    calls.append(f)
    assert iterations == 7
    return f"out-{f}", next(times[f]), {f: 0.0}

  monkeypatch.setattr(bench, "kernel_time_us", fake_kernel_time_us)
  row = {}
  timer = bench.Timer(row, argparse.Namespace(iterations=7, rounds=3))
  mesh = bench.one_device_mesh()
  out, t, names = timer.time("a", "a", 1, 2, mesh=mesh, scale=2)
  assert (out, t, names) == ("out-a", 20.0, {"a": 0.0})
  assert row["a_us"] == 20.0
  timer.time("b", "b", mesh=mesh)
  timer.finish()
  assert calls == ["a", "b", "a", "b", "a", "b"]
  assert row["a_rounds_us"] == [20.0, 60.0, 40.0]
  assert row["a_us"] == 40.0
  assert row["b_rounds_us"] == [5.0, 1.0, 3.0]
  assert row["b_us"] == 3.0


def test_one_round_keeps_the_first_time(monkeypatch):
  bench = _bench_kernels()
  monkeypatch.setattr(bench, "kernel_time_us",
                      lambda f, *o, iterations: (None, 4.0, {}))
  row = {}
  timer = bench.Timer(row, argparse.Namespace(iterations=1, rounds=1))
  timer.time("x", "f", mesh=bench.one_device_mesh())
  timer.finish()
  assert row == {"x_us": 4.0, "x_rounds_us": [4.0]}


def test_every_round_runs_under_the_mesh_its_method_was_timed_with(
    monkeypatch):
  """A one-device GEMM (the bound) and a shard_map over two devices, timed
  again round-robin from inside the two-device mesh (as bench_shape calls
  `finish`): each must find its own mesh, or jit refuses the devices."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  bench = _bench_kernels()

  def run_it(f, *operands, iterations):
    return jax.block_until_ready(f(*operands)), 1.0, {}

  monkeypatch.setattr(bench, "kernel_time_us", run_it)
  row = {}
  timer = bench.Timer(row, argparse.Namespace(iterations=1, rounds=2))
  dev0 = jax.devices()[0]
  la = jax.device_put(jnp.ones((8, 4)), dev0)
  lb = jax.device_put(jnp.ones((4, 2)), dev0)
  timer.time("bound", jax.jit(jnp.dot), la, lb, mesh=bench.one_device_mesh())
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(mesh):
    a = jax.sharding.reshard(jnp.ones((8, 4)), P("x", None))
    b = jax.sharding.reshard(jnp.ones((4, 2)), P(None, "x"))
    local = jax.jit(jax.shard_map(lambda x, y: x @ y,
                                  out_specs=P("x", None), check_vma=False))
    timer.time("local", local, a, b, mesh=mesh)
    timer.finish()
  assert row["bound_rounds_us"] == row["local_rounds_us"] == [1.0, 1.0]


def test_a_config_can_patch_each_shapes_picked_config():
  """`"selected": true` replaces fields of the config selection picks per
  shape; without it the JSON is the whole config; unknown fields fail."""
  bench = _bench_kernels()
  from collective_matmul import kernels  # pylint: disable=g-import-not-at-top
  picked = kernels.ReduceScatterConfig(send_gap=6, send_pieces=4,
                                       epi_tile_n=128)
  patch, loopback = bench.parse_config(
      kernels.ReduceScatterConfig,
      '{"selected": true, "chain_tiles": true, "loopback": true}')
  assert loopback
  assert bench.resolve_config(patch, picked) == kernels.ReduceScatterConfig(
      send_gap=6, send_pieces=4, epi_tile_n=128, chain_tiles=True)
  whole, loopback = bench.parse_config(kernels.ReduceScatterConfig,
                                       '{"chain_tiles": true}')
  assert not loopback
  assert bench.resolve_config(whole, picked) == kernels.ReduceScatterConfig(
      chain_tiles=True)
  assert bench.resolve_config(None, picked) is picked
  import pytest  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="no fields"):
    bench.parse_config(kernels.ReduceScatterConfig,
                       '{"selected": true, "chain": true}')
