"""The kernels' pure rules (`configs.sm_count`, `configs.dtype_reason`) and
their benchmark-only entry (`diagnostics.loopback`), on CPU."""
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul import kernels
from collective_matmul.kernels import configs
from collective_matmul.kernels import diagnostics


def _abstract_mesh(monkeypatch, device):
  monkeypatch.setattr(jax.sharding, "get_abstract_mesh",
                      lambda: types.SimpleNamespace(abstract_device=device))


def test_sm_count_reads_the_abstract_mesh_device(monkeypatch):
  _abstract_mesh(monkeypatch, types.SimpleNamespace(num_cores=114))
  assert configs.sm_count() == 114


def test_sm_count_of_a_given_device():
  assert configs.sm_count(types.SimpleNamespace(num_cores=78)) == 78
  assert configs.sm_count(types.SimpleNamespace(core_count=66)) == 66


@pytest.mark.parametrize("device", [None, types.SimpleNamespace(
    num_cores=None)])
def test_sm_count_falls_back_to_the_first_device_then_a_hopper(
    monkeypatch, device):
  """No count on the mesh: the first device's `core_count`; none there
  either (CPU): an H100/H200's 132."""
  _abstract_mesh(monkeypatch, device)
  assert configs.sm_count() == configs.DEFAULT_SM_COUNT == 132
  monkeypatch.setattr(jax, "devices",
                      lambda: [types.SimpleNamespace(core_count=144)])
  assert configs.sm_count() == 144
  assert configs.sm_count(device) == 144


@pytest.mark.parametrize("dtype,out_dtype", [
    (jnp.bfloat16, None), (jnp.bfloat16, jnp.bfloat16),
    (jnp.bfloat16, jnp.float32), ("float16", None), (np.float16, "float32"),
])
def test_dtype_reason_none_for_what_the_kernels_take(dtype, out_dtype):
  assert configs.dtype_reason(dtype, out_dtype) is None


@pytest.mark.parametrize("dtype,out_dtype,reason", [
    (jnp.float32, None, "dtype float32 (kernel takes bf16 or f16)"),
    ("int8", jnp.float32, "dtype int8 (kernel takes bf16 or f16)"),
    (jnp.bfloat16, jnp.float16, "preferred_element_type float16 (kernel "
     "gives bfloat16 or float32)"),
    (jnp.float16, jnp.bfloat16, "preferred_element_type bfloat16 (kernel "
     "gives float16 or float32)"),
])
def test_dtype_reason_names_the_offender(dtype, out_dtype, reason):
  assert configs.dtype_reason(dtype, out_dtype) == reason


def test_loopback_holds_only_while_the_wrapped_kernel_runs():
  seen = []

  def kernel(a, b, *, scale):
    seen.append(diagnostics.loopback_active())
    if scale is None:
      raise ValueError("no scale")
    return a * b * scale

  wrapped = diagnostics.loopback(kernel)
  assert wrapped.__wrapped__ is kernel
  assert wrapped(2, 3, scale=4) == 24
  with pytest.raises(ValueError):
    wrapped(2, 3, scale=None)
  kernel(2, 3, scale=1)
  assert seen == [True, True, False]
  assert not diagnostics.loopback_active()


def _mesh(d):
  return jax.make_mesh((d,), ("x",), devices=jax.devices()[:d],
                       axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.mark.parametrize("module,kernel,config,shapes,in_specs,out_spec", [
    ("all_gather_matmul_kernel", "all_gather_lhs_matmul", kernels.AllGatherConfig(),
     [(1024, 256), (256, 1024)], [P("x", None), P(None, "x")], P(None, "x")),
    ("matmul_reduce_scatter_kernel", "matmul_reduce_scatter",
     kernels.ReduceScatterConfig(), [(1024, 512), (512, 512)],
     [P(None, "x"), P("x", None)], P("x", None)),
])
def test_kernels_trace_their_ring_in_loopback_only_when_wrapped(
    monkeypatch, module, kernel, config, shapes, in_specs, out_spec):
  """The kernel body is built with loopback on under `diagnostics.loopback`
  and off otherwise, also when traced after a loopback trace."""
  import importlib  # pylint: disable=g-import-not-at-top
  mod = importlib.import_module(f"collective_matmul.kernels.{module}")
  real_ring_kernel = mod._ring_kernel  # pylint: disable=protected-access
  seen = []

  def spy(*args, diagnostic_loopback, **kwargs):
    seen.append(diagnostic_loopback)
    return real_ring_kernel(*args, diagnostic_loopback=diagnostic_loopback,
                            **kwargs)

  monkeypatch.setattr(mod, "_ring_kernel", spy)
  mesh = _mesh(2)
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16,
                               sharding=NamedSharding(mesh, spec))
          for s, spec in zip(shapes, in_specs)]
  plain = getattr(kernels, kernel)
  with jax.set_mesh(mesh):
    for fn in (diagnostics.loopback(plain), plain):
      jax.eval_shape(jax.shard_map(
          functools.partial(fn, axis_name="x", config=config),
          in_specs=tuple(in_specs), out_specs=out_spec, check_vma=False),
                     *args)
  assert seen == [True, False]


def test_one_epilogue_slot_takes_one_slot_of_shared_memory():
  """`epi_slots=1`: the whole warpgroup tile in one slot per warpgroup (a
  128 x 128 tile's epilogue in 64 KB, beside 3 pipeline stages); the
  default keeps two."""
  two = kernels.ReduceScatterConfig(epi_tile_m=128, epi_tile_n=128,
                                    max_concurrent_steps=3)
  one = kernels.ReduceScatterConfig(epi_tile_m=128, epi_tile_n=128,
                                    max_concurrent_steps=3, epi_slots=1)
  assert kernels.ReduceScatterConfig().epi_slots == 2
  assert two.smem_bytes(2, 2) - one.smem_bytes(2, 2) == 2 * 128 * 128 * 2
  assert one.smem_bytes(2, 2) <= configs.SMEM_BYTES
  with pytest.raises(ValueError, match="whole tile"):
    kernels.AllGatherConfig(epi_slots=1)  # 64 x 64 of a 128 x 128 tile.
  with pytest.raises(ValueError, match="1 or 2"):
    kernels.AllGatherConfig(epi_slots=3)


def test_pingpong_tiles_are_one_warpgroup_tile_on_one_device_only():
  """`pingpong`: each warpgroup takes whole CTA tiles (the CTA tile is the
  warpgroup tile, whatever `wg_dimension`), in one ring of slots; refused
  without chained tiles and on a ring (D > 1)."""
  split = kernels.AllGatherConfig(chain_tiles=True)
  pingpong = kernels.AllGatherConfig(chain_tiles=True, pingpong=True)
  assert (split.cta_tile_m, split.cta_tile_n) == (128, 256)
  assert (pingpong.cta_tile_m, pingpong.cta_tile_n) == (128, 128)
  assert (kernels.ReduceScatterConfig(
      tile_m=64, tile_n=256, wg_dimension="m", chain_tiles=True,
      pingpong=True).cta_tile_m) == 64
  # One ring of stages over the (smaller) CTA tile.
  assert pingpong.smem_bytes(2, 2) == (4 * 64 * 256 * 2 + 2 * 2 * 64 * 64 * 2
                                       + configs.SMEM_RESERVE)
  assert configs.axis_reason(pingpong, 1) is None
  # The all-gather's ring: its tiles must free the slots they forward
  # from at once, or dedicated senders forward.
  assert "needs eager_release=True" in configs.axis_reason(pingpong, 2)
  for ring_ready in (kernels.AllGatherConfig(chain_tiles=True, pingpong=True,
                                             eager_release=True),
                     kernels.AllGatherConfig(chain_tiles=True, pingpong=True,
                                             sender_sms=4),
                     kernels.ReduceScatterConfig(chain_tiles=True,
                                                 pingpong=True)):
    assert configs.axis_reason(ring_ready, 4) is None
  assert configs.axis_reason(split, 2) is None
  with pytest.raises(ValueError, match="chain_tiles=True"):
    kernels.AllGatherConfig(pingpong=True)
  # Stored configs from before the field read back unchanged.
  assert "pingpong" not in split.to_json()
  assert pingpong.to_json()["pingpong"] is True
