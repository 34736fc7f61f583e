"""The Hopper kernels' Python, traced on CPU.

Pallas traces a kernel body when it is called, so `jax.eval_shape` runs all
of the kernels' Python (schedule arithmetic, semaphore and buffer shapes,
layouts, padding, validation) without a GPU; only lowering needs one. The
numerics are checked on Hopper by tests/gpu.
"""
import functools
import re

import jax
from jax._src import core as jax_core  # jaxprs_in_params: JAX 0.10 to 0.12.
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul import kernels
from collective_matmul import selection

from cm_test_utils import pallas_mlp


@pytest.fixture(autouse=True)
def _describe_a_hopper_machine(monkeypatch):
  """The ops refuse impl="pallas" where no Hopper GPU is; these tests only
  trace the kernels' Python (abstract evaluation, nothing is lowered)."""
  monkeypatch.setattr(selection, "device_facts",
                      lambda mesh=None: selection.DeviceFacts(
                          "gpu", "NVIDIA H200", 132, 1, 8))


def _mesh(d):
  return jax.make_mesh((d,), ("x",), devices=jax.devices()[:d],
                       axis_types=(jax.sharding.AxisType.Explicit,))


def _spec(mesh, shape, spec, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype,
                              sharding=NamedSharding(mesh, spec))


CONFIGS = [None, kernels.AllGatherConfig(spread_sends=False),
           kernels.AllGatherConfig(wg_dimension="m", send_gap=4),
           kernels.AllGatherConfig(tile_m=64),
           kernels.AllGatherConfig(sender_sms=4),
           kernels.AllGatherConfig(wg_dimension="m", sender_sms=16),
           kernels.AllGatherConfig(sender_sms=3, k_major_sends=True),
           kernels.AllGatherConfig(eager_release=True),
           kernels.AllGatherConfig(eager_release=True, chain_tiles=True),
           kernels.AllGatherConfig(sender_sms=4, k_major_sends=True,
                                   chain_tiles=True),
           kernels.AllGatherConfig(tile_n=64, tile_k=128,
                                   max_concurrent_steps=3, sender_sms=4,
                                   k_major_sends=True),
           kernels.AllGatherConfig(eager_release=True, chain_tiles=True,
                                   max_concurrent_steps=3),
           kernels.AllGatherConfig(sender_sms=4, k_major_sends=True,
                                   chain_tiles=True, max_concurrent_steps=3),
           kernels.AllGatherConfig(sender_sms=4, chain_tiles=True,
                                   max_concurrent_steps=3)]


@pytest.mark.parametrize("d", [1, 2, 4])
@pytest.mark.parametrize("m", [512, 300])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_all_gather_kernel_traces_with_the_shapes_it_promises(d, m, config):
  mesh = _mesh(d)
  k, n = 256, 384
  config = config or selection.select_config(m, k, n, jnp.bfloat16, d)
  with jax.set_mesh(mesh):
    f = jax.shard_map(
        functools.partial(kernels.all_gather_lhs_matmul, axis_name="x",
                          config=config, return_gathered=True),
        out_specs=(P(None, "x"), P("x")), check_vma=False)
    out, held = jax.eval_shape(f, _spec(mesh, (d * m, k), P("x", None)),
                               _spec(mesh, (k, d * n), P(None, "x")))
  assert out.shape == (d * m, d * n) and out.dtype == jnp.bfloat16
  assert held.shape == (d * d, m, k)


RS_CONFIGS = [None,
              kernels.ReduceScatterConfig(spread_sends=False, send_gap=2),
              kernels.ReduceScatterConfig(epi_tile_n=128, send_pieces=4,
                                          send_gap=3, max_concurrent_steps=3),
              kernels.ReduceScatterConfig(chain_tiles=True),
              kernels.ReduceScatterConfig(epi_tile_n=128, send_pieces=2,
                                          max_concurrent_steps=3,
                                          chain_tiles=True)]


@pytest.mark.parametrize("d", [1, 2, 4])
@pytest.mark.parametrize("m,n", [(512, 512), (200, 384)])
@pytest.mark.parametrize("k", [256, 64])  # 64: a one-step k loop.
@pytest.mark.parametrize("config", RS_CONFIGS, ids=str)
def test_reduce_scatter_kernel_traces_with_the_shapes_it_promises(
    d, m, n, k, config):
  mesh = _mesh(d)
  # The picked config fits f32 partial sums; the explicit ones (4 stages,
  # 64 x 64 epilogue) fit bf16.
  out_dtype = jnp.float32 if config is None else jnp.bfloat16
  config = config or selection.select_reduce_scatter_config(
      m, k, n, jnp.bfloat16, d, out_dtype=out_dtype)
  with jax.set_mesh(mesh):
    f = jax.shard_map(
        functools.partial(kernels.matmul_reduce_scatter, axis_name="x",
                          out_dtype=out_dtype, config=config),
        out_specs=P("x", None), check_vma=False)
    out = jax.eval_shape(f, _spec(mesh, (d * m, d * k), P(None, "x")),
                         _spec(mesh, (d * k, n), P("x", None)))
  assert out.shape == (d * m, n) and out.dtype == out_dtype


def test_batch_major_rows_trace_for_both_kernels():
  mesh = _mesh(2)
  with jax.set_mesh(mesh):
    gather = jax.shard_map(
        lambda x, w: kernels.all_gather_lhs_matmul(
            x.reshape(-1, 256), w, "x", rows_per_batch=256,
            config=kernels.AllGatherConfig()).reshape(3, 512, -1),
        out_specs=P(None, None, "x"), check_vma=False)
    out = jax.eval_shape(gather, _spec(mesh, (3, 512, 256), P(None, "x", None)),
                         _spec(mesh, (256, 512), P(None, "x")))
    assert out.shape == (3, 512, 512)
    scatter = jax.shard_map(
        lambda x, w: kernels.matmul_reduce_scatter(
            x.reshape(-1, x.shape[-1]), w, "x", rows_per_batch=256,
            config=kernels.ReduceScatterConfig()).reshape(3, 256, -1),
        out_specs=P(None, "x", None), check_vma=False)
    out = jax.eval_shape(scatter, _spec(mesh, (3, 512, 512), P(None, None, "x")),
                         _spec(mesh, (512, 256), P("x", None)))
    assert out.shape == (3, 512, 256)


@pytest.mark.parametrize("save_gathered", [False, True])
def test_pallas_ops_trace_forward_and_backward(save_gathered):
  """value_and_grad through both ops with impl="pallas" (both kernels in the
  forward and, transposed, in the backward)."""
  mesh = _mesh(2)
  with jax.set_mesh(mesh):
    f = jax.shard_map(pallas_mlp(save_gathered), out_specs=P(None, "x", None),
                      check_vma=False)
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))
    args = (_spec(mesh, (2, 512, 256), P(None, "x", None)),
            _spec(mesh, (256, 1024), P(None, "x")),
            _spec(mesh, (1024, 256), P("x", None)))
    value, grads = jax.eval_shape(jax.value_and_grad(loss, (0, 1, 2)), *args)
    jaxpr = str(jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(*args))
  assert value.shape == ()
  assert [g.shape for g in grads] == [a.shape for a in args]
  # Two forward kernels and two backward kernels (a Mosaic GPU kernel of
  # several warpgroups is an `mpmd_map`); with save_gathered no all-gather is
  # left for the weight gradients, without it both re-gather.
  assert jaxpr.count("mpmd_map[") == 4
  assert jaxpr.count("all_gather[") == (0 if save_gathered else 2)


@pytest.mark.parametrize("bad,match", [
    (dict(lhs=jnp.float32), r"dtype float32 \(kernel takes bf16 or f16\)"),
    (dict(out_dtype=jnp.float16), "preferred_element_type float16"),
    (dict(rows_per_batch=96), "rows_per_batch=96 must divide"),
    # Every block a sender: nothing would compute the output.
    (dict(config=kernels.AllGatherConfig(sender_sms=132)),
     "sender_sms=132 leaves no block"),
])
def test_kernel_rejects_bad_input_naming_it(bad, match):
  mesh = _mesh(2)
  dtype = bad.get("lhs", jnp.bfloat16)
  kwargs = {key: v for key, v in bad.items() if key != "lhs"}
  kwargs.setdefault("config", kernels.AllGatherConfig())
  with jax.set_mesh(mesh):
    f = jax.shard_map(
        functools.partial(kernels.all_gather_lhs_matmul, axis_name="x",
                          **kwargs),
        out_specs=P(None, "x"), check_vma=False)
    with pytest.raises(ValueError, match=match):
      jax.eval_shape(f, _spec(mesh, (1024, 256), P("x", None), dtype),
                     _spec(mesh, (256, 512), P(None, "x"), dtype))


@pytest.mark.parametrize("k,n,rows_per_batch,match", [
    (256, 256, 96, "rows_per_batch=96 must divide"),
    (200, 256, 128, "rows_per_batch needs k=100"),  # k per device pads.
    (256, 256, None, None),
    (256, 256, 128, None),
])
def test_reduce_scatter_kernel_checks_its_row_layout(k, n, rows_per_batch,
                                                      match):
  mesh = _mesh(2)
  with jax.set_mesh(mesh):
    f = jax.shard_map(
        functools.partial(kernels.matmul_reduce_scatter, axis_name="x",
                          rows_per_batch=rows_per_batch,
                          config=kernels.ReduceScatterConfig()),
        out_specs=P("x", None), check_vma=False)
    args = (_spec(mesh, (2 * 512, k), P(None, "x")),
            _spec(mesh, (k, n), P("x", None)))
    if match is None:
      assert jax.eval_shape(f, *args).shape == (2 * 512, n)
    else:
      with pytest.raises(ValueError, match=match):
        jax.eval_shape(f, *args)


@pytest.mark.parametrize("kernel,wrong,specs", [
    ("all_gather_lhs_matmul", kernels.ReduceScatterConfig(),
     (P("x", None), P(None, "x"))),
    ("matmul_reduce_scatter", kernels.AllGatherConfig(),
     (P(None, "x"), P("x", None)))])
def test_each_kernel_takes_only_its_own_config(kernel, wrong, specs):
  mesh = _mesh(2)
  with jax.set_mesh(mesh):
    f = jax.shard_map(
        functools.partial(getattr(kernels, kernel), axis_name="x",
                          config=wrong),
        out_specs=P("x", None), check_vma=False)
    with pytest.raises(TypeError, match=re.escape(f"config={wrong!r}")):
      jax.eval_shape(f, _spec(mesh, (1024, 512), specs[0]),
                     _spec(mesh, (512, 256), specs[1]))


def _trace_both_kernels(mesh, config=None, rs_config=None):
  with jax.set_mesh(mesh):
    gather = jax.shard_map(
        functools.partial(kernels.all_gather_lhs_matmul, axis_name="x",
                          config=config or kernels.AllGatherConfig()),
        out_specs=P(None, "x"), check_vma=False)
    jax.eval_shape(gather, _spec(mesh, (1024, 512), P("x", None)),
                   _spec(mesh, (512, 1024), P(None, "x")))
    scatter = jax.shard_map(
        functools.partial(kernels.matmul_reduce_scatter, axis_name="x",
                          config=rs_config or kernels.ReduceScatterConfig()),
        out_specs=P("x", None), check_vma=False)
    jax.eval_shape(scatter, _spec(mesh, (1024, 1024), P(None, "x")),
                   _spec(mesh, (1024, 512), P("x", None)))


@pytest.mark.parametrize("d", [1, 2])
def test_trace_warpgroups_asks_mosaic_for_its_profile(d, monkeypatch,
                                                       tmp_path):
  """Inside `trace_warpgroups` both kernels are built with the on-device
  profiler on (its space and directory); outside, without."""
  from collective_matmul.kernels import ring_skeleton  # pylint: disable=g-import-not-at-top
  seen = []
  real_kernel = ring_skeleton.plgpu.kernel

  def spy(body, **kwargs):
    seen.append(kwargs["compiler_params"])
    return real_kernel(body, **kwargs)

  monkeypatch.setattr(ring_skeleton.plgpu, "kernel", spy)
  mesh = _mesh(d)
  with kernels.trace_warpgroups(tmp_path, ranges_per_warpgroup=40):
    _trace_both_kernels(mesh)
  _trace_both_kernels(mesh)
  assert [(p.profile_space, p.profile_dir) for p in seen] == [
      (40, str(tmp_path))] * 2 + [(0, "")] * 2


def test_trace_warpgroups_counts_its_shared_memory(tmp_path):
  """The default all-gather config leaves about 2.8 KB of shared memory: 40
  ranges (1.9 KB) fit, 100 (4.8 KB) are refused, naming the trace."""
  mesh = _mesh(2)
  full = kernels.AllGatherConfig(tile_n=128, wg_dimension="n",
                                 max_concurrent_steps=4, epi_tile_n=64)
  with kernels.trace_warpgroups(tmp_path, ranges_per_warpgroup=40):
    _trace_both_kernels(mesh, config=full)
  with kernels.trace_warpgroups(tmp_path, ranges_per_warpgroup=100):
    with pytest.raises(ValueError, match="4800 for `trace_warpgroups`"):
      _trace_both_kernels(mesh, config=full)
  with pytest.raises(ValueError, match="ranges_per_warpgroup"):
    with kernels.trace_warpgroups(tmp_path, ranges_per_warpgroup=0):
      pass


def test_a_chain_off_the_depth_needs_its_first_step():
  """A chained pipeline whose k steps are no multiple of its depth runs on
  `_OffsetChain`, which has to know where the block's slots stand."""
  from collective_matmul.kernels import pipeline  # pylint: disable=g-import-not-at-top
  kwargs = dict(cta_tile_m=128, cta_tile_n=256, tile_k=64, dtype=jnp.bfloat16,
                max_concurrent_steps=3, delay_release=0, chained=True)
  with pytest.raises(ValueError, match="needs first_step"):
    pipeline.matmul_pipeline(None, None, k_iters=16, **kwargs)
  assert isinstance(pipeline.matmul_pipeline(None, None, k_iters=16,
                                             first_step=0, **kwargs),
                    pipeline._OffsetChain)  # pylint: disable=protected-access
  assert not isinstance(pipeline.matmul_pipeline(None, None, k_iters=15,
                                                 **kwargs),
                        pipeline._OffsetChain)  # pylint: disable=protected-access


def test_only_the_listed_phases_are_traced():
  """A phase is a named scope on what it wraps (what the profiler records
  as a range); an unlisted name is refused."""
  from collective_matmul.kernels import tracing  # pylint: disable=g-import-not-at-top

  def f(x):
    with tracing.phase("epilogue"):
      return x * 2

  [eqn] = jax.make_jaxpr(f)(1.0).eqns
  assert "epilogue" in str(eqn.source_info.name_stack)
  with pytest.raises(ValueError, match="not one of"):
    tracing.phase("mma_loop")


def _wgmma_wait_depths(jaxpr):
  """The `n` of every `wgmma_wait` in a traced kernel, nested jaxprs
  included (a parameter from JAX 0.12, an operand before)."""
  depths = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "wgmma_wait":
      n = eqn.params.get("n")
      depths.append(n if n is not None else eqn.invars[0].val)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          depths.extend(_wgmma_wait_depths(inner))
  return depths


@pytest.mark.parametrize("kernel,config,delay", [
    ("rs", kernels.ReduceScatterConfig(), 0),
    ("rs", kernels.ReduceScatterConfig(chain_tiles=True), 0),
    ("rs", kernels.ReduceScatterConfig(epi_tile_n=128, send_pieces=2,
                                       max_concurrent_steps=3,
                                       chain_tiles=True), 0),
    ("ag", kernels.AllGatherConfig(eager_release=True, chain_tiles=True), 0),
    ("ag", kernels.AllGatherConfig(eager_release=True, chain_tiles=True,
                                   max_concurrent_steps=3), 0),
    ("ag", kernels.AllGatherConfig(sender_sms=4, k_major_sends=True), 0),
    ("ag", kernels.AllGatherConfig(tile_m=64, tile_n=256,
                                   wg_dimension="m", sender_sms=4), 0),
    # The tiles forward from their slots, released one step late.
    ("ag", kernels.AllGatherConfig(), 1),
], ids=str)
def test_no_slot_is_freed_while_a_wgmma_still_reads_it(kernel, config, delay):
  """Run 48: with slots freed as the step's body returns
  (`delay_release=0`), a wgmma left in flight read a slot the next load
  was already overwriting: wrong results at 64 x 256 warpgroup tiles. The
  pipeline now waits until at most `delay_release` steps' wgmmas are in
  flight; this checks every wait in the traced kernel (D = 2)."""
  mesh = _mesh(2)
  with jax.set_mesh(mesh):
    if kernel == "ag":
      f = jax.shard_map(functools.partial(
          kernels.all_gather_lhs_matmul, axis_name="x", config=config),
          out_specs=P(None, "x"), check_vma=False)
      args = (_spec(mesh, (1024, 512), P("x", None)),
              _spec(mesh, (512, 1024), P(None, "x")))
    else:
      f = jax.shard_map(functools.partial(
          kernels.matmul_reduce_scatter, axis_name="x", config=config),
          out_specs=P("x", None), check_vma=False)
      args = (_spec(mesh, (1024, 1024), P(None, "x")),
              _spec(mesh, (1024, 512), P("x", None)))
    depths = _wgmma_wait_depths(jax.make_jaxpr(f)(*args).jaxpr)
  assert depths and set(depths) == {delay}, depths


@pytest.mark.parametrize("kernel,config,delay", [
    ("ag", kernels.AllGatherConfig(tile_k=128), 1),
    ("ag", kernels.AllGatherConfig(tile_k=128, eager_release=True,
                                   chain_tiles=True,
                                   max_concurrent_steps=3), 0),
    ("ag", kernels.AllGatherConfig(tile_k=128, sender_sms=4,
                                   k_major_sends=True), 0),
    ("rs", kernels.ReduceScatterConfig(tile_k=128, chain_tiles=True), 0),
], ids=str)
def test_no_slot_is_freed_while_a_wgmma_still_reads_it_in_the_fp8_rings(
    kernel, config, delay):
  """The same check for the fp8 rings (D = 2; e4m3, the weight K-major):
  their k loop is the bf16 one with B's slots read transposed."""
  mesh = _mesh(2)
  e4m3 = jnp.float8_e4m3fn
  scale = _spec(mesh, (), P(), jnp.float32)
  with jax.set_mesh(mesh):
    if kernel == "ag":
      f = jax.shard_map(lambda a, b, s: kernels.all_gather_lhs_matmul(
          a, b, "x", config=config, weight_layout="nk", scale=s),
                        out_specs=P(None, "x"), check_vma=False)
      args = (_spec(mesh, (1024, 512), P("x", None), e4m3),
              _spec(mesh, (1024, 512), P("x", None), e4m3), scale)
    else:
      f = jax.shard_map(lambda a, b, s: kernels.matmul_reduce_scatter(
          a, b, "x", config=config, weight_layout="nk", scale=s),
                        out_specs=P("x", None), check_vma=False)
      args = (_spec(mesh, (1024, 1024), P(None, "x"), e4m3),
              _spec(mesh, (512, 1024), P(None, "x"), e4m3), scale)
    depths = _wgmma_wait_depths(jax.make_jaxpr(f)(*args).jaxpr)
  assert depths and set(depths) == {delay}, depths


def _core_wait_depths(config):
  """The wgmma waits (`_wgmma_wait_depths`) of the kernel that takes
  `config`, traced on a one-device mesh at 1024 x 1600 x 512."""
  mesh = _mesh(1)
  kernel = (kernels.all_gather_lhs_matmul
            if isinstance(config, kernels.AllGatherConfig)
            else kernels.matmul_reduce_scatter)
  with jax.set_mesh(mesh):
    f = jax.shard_map(functools.partial(kernel, axis_name="x",
                                        config=config),
                      in_specs=(P(), P()), out_specs=P(), check_vma=False)
    return _wgmma_wait_depths(jax.make_jaxpr(f)(
        _spec(mesh, (1024, 1600), P()), _spec(mesh, (1600, 512), P())).jaxpr)


@pytest.mark.parametrize("config", [
    kernels.AllGatherConfig(epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                            max_concurrent_steps=3, chain_tiles=True),
    kernels.ReduceScatterConfig(tile_m=64, tile_n=256, wg_dimension="m",
                                epi_tile_m=64, epi_tile_n=256, epi_slots=1,
                                max_concurrent_steps=3, send_pieces=2,
                                chain_tiles=True)], ids=str)
def test_no_slot_is_freed_while_a_wgmma_still_reads_it_in_the_core(config):
  """The same check on a one-device mesh (no ring, so slots are freed at
  once) for the core variants: one-slot epilogues."""
  depths = _core_wait_depths(config)
  assert depths and set(depths) == {0}, depths


@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("config", [
    kernels.AllGatherConfig(epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                            max_concurrent_steps=3, chain_tiles=True,
                            eager_release=True),
    kernels.AllGatherConfig(tile_m=64, tile_n=256, wg_dimension="m",
                            epi_tile_m=64, epi_tile_n=256, epi_slots=1,
                            max_concurrent_steps=3, sender_sms=4),
    kernels.ReduceScatterConfig(epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                                max_concurrent_steps=3, send_pieces=2),
    kernels.ReduceScatterConfig(tile_m=64, tile_n=256, wg_dimension="m",
                                epi_tile_m=64, epi_tile_n=256, epi_slots=1,
                                max_concurrent_steps=3, send_pieces=2,
                                chain_tiles=True)], ids=str)
def test_one_slot_epilogues_trace_in_the_core_and_the_ring(config, d):
  """`epi_slots=1` is not refused by the rings (its partial sums go through
  the one slot); timed only in the core so far."""
  mesh = _mesh(d)
  if isinstance(config, kernels.AllGatherConfig):
    kernel, specs, out_spec = kernels.all_gather_lhs_matmul, (
        P("x", None), P(None, "x")), P(None, "x")
  else:
    kernel, specs, out_spec = kernels.matmul_reduce_scatter, (
        P(None, "x"), P("x", None)), P("x", None)
  with jax.set_mesh(mesh):
    out = jax.eval_shape(jax.jit(jax.shard_map(
        functools.partial(kernel, axis_name="x", config=config),
        in_specs=specs, out_specs=out_spec, check_vma=False)),
                         _spec(mesh, (1024, 1024), specs[0]),
                         _spec(mesh, (1024, 1024), specs[1]))
  assert out.shape[1] == 1024


@pytest.mark.parametrize("config", [
    kernels.AllGatherConfig(pingpong=True, chain_tiles=True),
    kernels.ReduceScatterConfig(pingpong=True, chain_tiles=True,
                                epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                                max_concurrent_steps=5)], ids=str)
def test_pingpong_keeps_one_step_in_flight_then_drains(config):
  """Ping-pong (`TileConfig.pingpong`): the tile's owner waits until one
  step's wgmmas are in flight in its k loop (it frees the previous step's
  slot) and for all of them after it (the last slot, then the epilogue
  reads the accumulator): every pipeline's waits are (1, 0)."""
  depths = _core_wait_depths(config)
  assert depths and depths == [1, 0] * (len(depths) // 2), depths


@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("n,copies", [(320, False), (264, True),
                                     (260, True)])
@pytest.mark.parametrize("pattern", ["all_gather", "reduce_scatter"])
def test_columns_off_the_tiles_are_left_to_tma(pattern, n, copies, d):
  """m and k fit the tiles, n does not: the last column tile's loads read
  zeros and its stores drop what lies past n (TMA), so no pad and no slice
  surround the kernel; where n is not a whole number of the shared-memory
  tiling's width (64 bf16 columns: 264, 260) they still do, as TMA needs
  (`ring_skeleton.clips_columns`; tests/kernels/test_kernel_lowering
  lowers them). The numerics: tests/kernels/test_kernel_interpret and
  tests/gpu."""
  mesh = _mesh(d)
  m, k = 256, 128
  if pattern == "all_gather":
    kernel, specs = kernels.all_gather_lhs_matmul, (P("x", None), P())
    config, out_spec = kernels.AllGatherConfig(), P()
    shapes = ((d * m, k), (k, n))
  else:
    kernel, specs = kernels.matmul_reduce_scatter, (P(None, "x"), P("x"))
    config, out_spec = kernels.ReduceScatterConfig(), P("x", None)
    shapes = ((d * m, d * k), (d * k, n))
  with jax.set_mesh(mesh):
    f = jax.jit(jax.shard_map(
        functools.partial(kernel, axis_name="x", config=config),
        in_specs=specs, out_specs=out_spec, check_vma=False))
    args = [_spec(mesh, s, p) for s, p in zip(shapes, specs)]
    assert jax.eval_shape(f, *args).shape == (d * m, n)
    around = _primitives_around_kernels(jax.make_jaxpr(f)(*args).jaxpr)
  assert ("pad" in around) == copies
  assert ("slice" in around) == copies


# What a Mosaic GPU kernel call is traced as (`plgpu.kernel`: the kernel's
# body is a jaxpr inside these), and `pallas_call`.
KERNEL_CALLS = {"custom_vmap_call", "mpmd_map", "core_map", "pallas_call"}


def _primitives_around_kernels(jaxpr):
  """The primitives of `jaxpr` and the jaxprs it calls, not looking inside
  the kernels (`KERNEL_CALLS`)."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    if eqn.primitive.name in KERNEL_CALLS:
      continue
    for sub in jax_core.jaxprs_in_params(eqn.params):
      names |= _primitives_around_kernels(sub)
  return names
