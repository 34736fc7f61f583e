"""fp8 problems through the selection: the kernels serve the fp8 pairs the
wgmma takes (e4m3 x e4m3, e5m2 x e4m3) with a config they can run (k steps
of 128, shared memory at 1-byte operands), measured configs are keyed by
the operands' dtypes (a bf16 entry never serves fp8), the backward's
problem is the one the op's own backward runs, and the plan names the
dtypes it runs.

Decisions only: nothing runs on the Hopper GPUs described here.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from collective_matmul import dispatch
from collective_matmul import kernels
from collective_matmul import selection
from collective_matmul.kernels import configs
from collective_matmul.selection import heuristics
from collective_matmul.selection import tuned

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
H200 = selection.DeviceFacts("gpu", "NVIDIA H200", 132)
CPU = selection.DeviceFacts("cpu", "cpu", 1)
_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
MIXED_OK = _VERSION >= (0, 11)  # JAX 0.10's wgmma takes one dtype.
PAIRS = {"e4m3_e4m3": (E4M3, None), "e5m2_e4m3": (E5M2, E4M3)}
# Per-shard (rows, k, n) and D: large and small, k and n off the tiles.
SHAPES = [((4096, 4096, 2048), 2), ((1024, 4096, 3584), 4),
          ((128, 4096, 2048), 2), ((2048, 2048, 2048), 1),
          ((512, 1000, 768), 2), ((8192, 14336, 4096), 2)]


@pytest.fixture(autouse=True)
def _command_buffers_off_no_cache(monkeypatch, tmp_path):
  """XLA command buffers off (a decision independent of this JAX); no per-host
  autotune cache unless a test writes one."""
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  monkeypatch.setenv("COLLECTIVE_MATMUL_TUNING_CACHE",
                     str(tmp_path / "tuning.json"))
  tuned._logged_misses.clear()  # pylint: disable=protected-access


def _problem(shape, d, pair, out=BF16):
  lhs, rhs = PAIRS[pair]
  return selection.Problem(*shape, lhs, d, out, rhs)


def _runs_here(pair):
  return pair == "e4m3_e4m3" or MIXED_OK


@pytest.mark.parametrize("out", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("shape,d", SHAPES, ids=str)
def test_pallas_serves_fp8_with_a_config_the_fp8_core_runs(
    shape, d, collective, pair, out):
  problem = _problem(shape, d, pair, out)
  plan = selection.choose("pallas", collective, problem, H200)
  if not _runs_here(pair):
    assert plan.is_fallback and plan.impl == "baseline"
    assert "need JAX >= 0.11" in plan.reason
    return
  assert plan.impl == "pallas" and not plan.is_fallback, plan.reason
  config = plan.config
  expected = (kernels.AllGatherConfig if collective == "all_gather"
              else kernels.ReduceScatterConfig)
  assert type(config) is expected  # pylint: disable=unidiomatic-typecheck
  assert config.tile_k == configs.FP8_TILE_K
  lhs, rhs = problem.operand_dtypes
  assert configs.fp8_reason(lhs, rhs, out, True, config.tile_k) is None
  assert config.smem_bytes(1, out.itemsize) <= configs.SMEM_BYTES
  assert configs.axis_reason(config, d) is None
  # The heuristics take as many stages at 1-byte operands as fit: one more
  # would not.
  deeper = config.__class__(**dict(
      config.__dict__, max_concurrent_steps=config.max_concurrent_steps + 1))
  assert (deeper.smem_bytes(1, out.itemsize) > configs.SMEM_BYTES
          or config.max_concurrent_steps >= 4)


def _pick(collective, shape, d, dtype, rhs=None, out=BF16):
  return selection.config_for(collective,
                              selection.Problem(*shape, dtype, d, out, rhs),
                              H200)[0]


def _split_pick(monkeypatch, collective, shape, d, dtype, rhs=None):
  """The pick without `heuristics._wide_tiles` (the 128 x 256 CTA tile split
  along n into two 128 x 128 warpgroup tiles and two epilogue slots)."""
  with monkeypatch.context() as m:
    m.setattr(heuristics, "_wide_tiles", lambda config, problem: config)
    return _pick(collective, shape, d, dtype, rhs)


WIDE = dict(tile_m=64, tile_n=256, wg_dimension="m", epi_tile_m=64,
            epi_tile_n=256, epi_slots=1, max_concurrent_steps=3,
            chain_tiles=True)
# bf16 and fp8 alike (`heuristics._wide_tiles`; fp8 only until 2026-12-06).
DTYPES = pytest.mark.parametrize("dtype", [BF16, E4M3], ids=["bf16", "e4m3"])


def _fields(config, names):
  return {name: getattr(config, name) for name in names}


@DTYPES
@pytest.mark.parametrize("shape,d", [
    ((8192, 2048, 4096), 2),    # By-rows senders, chained.
    ((8192, 4096, 4096), 2),
    ((2048, 2048, 2048), 1),    # One device: no ring.
], ids=str)
def test_all_gather_splits_its_128x256_tile_along_m_where_slots_free_at_once(
    shape, d, dtype, monkeypatch):
  """The all-gather: the 128 x 256 CTA tile as two 64 x 256 warpgroup
  tiles, each in one epilogue slot, chained, where the split pick had two
  128 x 128 warpgroup tiles. The same CTA tile, so the same senders."""
  pick = _pick("all_gather", shape, d, dtype)
  split = _split_pick(monkeypatch, "all_gather", shape, d, dtype)
  assert _fields(pick, WIDE) == WIDE
  assert (split.tile_m, split.tile_n, split.wg_dimension) == (128, 128, "n")
  assert (pick.cta_tile_m, pick.cta_tile_n) == (split.cta_tile_m,
                                                split.cta_tile_n)
  assert (pick.sender_sms, pick.k_major_sends) == (split.sender_sms,
                                                   split.k_major_sends)


@DTYPES
@pytest.mark.parametrize("shape,d,why", [
    ((8192, 4096, 2048), 2, "eager_release"),   # Tiles forward their blocks.
    ((768, 4096, 14336), 2, "forwarding"),      # ... released a step late.
    ((1024, 4096, 4096), 2, "k_major_sends"),   # One tile per SM and step.
    ((1024, 4096, 3584), 4, "forwarding"),
    ((8192, 4096, 5504), 2, "wg_dimension"),    # A 256 x 128 CTA tile.
], ids=str)
def test_all_gather_keeps_two_slots_where_the_ring_needs_them(
    shape, d, why, dtype, monkeypatch):
  """Where a ring's tiles forward k blocks from their pipeline slots, the
  one-slot epilogue's shared memory (3 stages, not 4) would cost them a
  stage of prefetch; the k-major senders run one tile per SM and ring
  step; other CTA tiles are not 128 x 256."""
  pick = _pick("all_gather", shape, d, dtype)
  assert pick.epi_slots == 2, why
  assert pick == _split_pick(monkeypatch, "all_gather", shape, d, dtype)
  if why == "eager_release":
    assert pick.eager_release
  if why == "k_major_sends":
    assert pick.k_major_sends
  if why == "forwarding":
    assert not pick.sender_sms and not pick.eager_release


@DTYPES
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_two_slots_kept_where_one_would_leave_two_stages(collective, dtype):
  """With f32 results the one-slot epilogue takes 128 KB and leaves 2
  pipeline stages: the pick keeps the split tiles and their deeper
  pipeline."""
  rhs = E4M3 if dtype == E4M3 else None
  problem = selection.Problem(8192, 2048, 4096, dtype, 2, F32, rhs)
  config = heuristics.reduce_scatter_config(problem, 132) if (
      collective == "reduce_scatter") else heuristics.all_gather_config(
          problem, 132)
  assert config.epi_slots == 2 and config.wg_dimension == "n"
  assert config.max_concurrent_steps >= heuristics.WIDE_MIN_STAGES


@pytest.mark.parametrize("pair", [(BF16, None), (E5M2, E4M3)],
                         ids=["bf16", "e5m2_e4m3"])
@pytest.mark.parametrize("shape,d", [
    ((8192, 2048, 4096), 2), ((1024, 4096, 4096), 2), ((8192, 4096, 2048), 2),
    ((2048, 4096, 4096), 4),
], ids=str)
def test_reduce_scatter_takes_one_slot_with_the_same_partial_sum_stores(
    shape, d, pair, monkeypatch):
  """The reduce-scatter: the 128 x 256 CTA tile as two 64 x 256 warpgroup
  tiles, each in one epilogue slot, chained; the partial sum in twice the
  row pieces, so it leaves in as many stores of the same size at the same
  steps as from the split pick's two slots (heuristics only: bf16's
  packaged table has a measured entry at one of these shapes)."""
  def pick():
    return heuristics.reduce_scatter_config(
        selection.Problem(*shape, pair[0], d, BF16, pair[1]), H200.num_cores)
  wide = pick()
  with monkeypatch.context() as m:
    m.setattr(heuristics, "_wide_tiles", lambda config, problem: config)
    split = pick()
  assert _fields(wide, WIDE) == WIDE
  assert (split.tile_m, split.tile_n, split.wg_dimension, split.epi_slots) == (
      128, 128, "n", 2)
  assert (split.epi_tile_m, split.epi_tile_n) == (64, 128)
  stores = lambda c: (2 if c.epi_slots == 2 else 1) * c.send_pieces
  piece_bytes = lambda c: (c.epi_tile_m // c.send_pieces) * c.epi_tile_n
  assert stores(wide) == stores(split)
  assert piece_bytes(wide) == piece_bytes(split)
  assert wide.send_gap == split.send_gap
  assert wide.max_concurrent_steps == split.max_concurrent_steps == 3


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_auto_takes_the_fp8_kernel_where_it_pays_off(collective):
  """The fp8 rings ran on one GPU (virtual ranks, D = 2, 4, 8; two
  processes, D = 2: benchmarks/rings_one_gpu), so `auto` takes them by its
  bf16 rules, as it does the fp8 cores on a one-device axis."""
  for d in (1, 2, 4):
    problem = _problem((4096, 4096, 2048), d, "e4m3_e4m3")
    plan = selection.choose("auto", collective, problem, H200)
    assert plan.impl == "pallas" and plan.reason == ""
    assert plan.backward_impl == "pallas"
  small = _problem((512, 1000, 768), 2, "e4m3_e4m3")
  plan = selection.choose("auto", collective, small, H200)
  assert plan.impl == "baseline" and "output tiles per ring step" in (
      plan.reason)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_fp8_the_kernels_do_not_take_runs_xla_on_hopper_not_the_ring(
    collective):
  """e4m3 x e5m2 (no wgmma pair of the kernels) and an fp8 result: the
  baseline (XLA's fp8 GEMM) on a Hopper GPU; off Hopper `fallback_impl`."""
  for problem, why in (
      (selection.Problem(4096, 4096, 2048, E4M3, 2, BF16, E5M2),
       "float8_e4m3fn x float8_e5m2"),
      (selection.Problem(4096, 4096, 2048, E4M3, 2), "an fp8 result")):
    auto = selection.choose("auto", collective, problem, H200)
    assert auto.impl == "baseline" and why in auto.reason
    pallas = selection.choose("pallas", collective, problem, H200)
    assert pallas.is_fallback and pallas.impl == "baseline"
    assert selection.choose("auto", collective, problem, CPU).impl == "ring"


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_a_caller_config_with_16_bit_k_steps_is_refused_for_fp8(collective):
  problem = _problem((4096, 4096, 2048), 2, "e4m3_e4m3")
  cls = (kernels.AllGatherConfig if collective == "all_gather"
         else kernels.ReduceScatterConfig)
  plan = selection.choose("pallas", collective, problem, H200,
                          config=cls(tile_k=64))
  assert plan.is_fallback and plan.impl == "baseline"
  assert "tile_k=64 with fp8" in plan.reason
  plan = selection.choose("pallas", collective, problem, H200,
                          config=cls(tile_k=128))
  assert plan.impl == "pallas" and plan.source == selection.CALLER


def test_a_config_over_shared_memory_is_refused():
  problem = _problem((4096, 4096, 2048), 2, "e4m3_e4m3", F32)
  # 4 stages of 128 x 256 x 128 fp8 and f32 epilogue slots: 246 KB.
  config = kernels.AllGatherConfig(tile_k=128)
  assert config.smem_bytes(1, 4) > configs.SMEM_BYTES
  plan = selection.choose("pallas", "all_gather", problem, H200,
                          config=config)
  assert plan.is_fallback and "shared memory" in plan.reason


@pytest.mark.parametrize("out", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_the_backward_problem_is_what_the_ops_backward_runs(pair, out):
  """The op's backward (primitives' transpose) multiplies the cotangent (in
  the result's dtype) by w.T in the wider of the two, and writes an fp8
  activation's gradient in that dtype (rounded to fp8 once, after)."""
  problem = _problem((1024, 512, 256), 2, pair, out)
  lhs, rhs = problem.operand_dtypes
  ct = jax.ShapeDtypeStruct((1024, 256), out)
  w = jax.ShapeDtypeStruct((512, 256), rhs)
  ct_b, w_t = jax.eval_shape(dispatch.times_weight_transposed, ct, w)
  back = problem.backward()
  assert (back.rows, back.k, back.n) == (1024, 256, 512)
  assert back.operand_dtypes == (ct_b.dtype, w_t.dtype) == (out, out)
  assert back.result_dtype == out  # An fp8 lhs: the cotangent's dtype.
  assert not back.is_fp8 and lhs.itemsize == 1


def test_the_backward_problem_of_16_bit_operands_is_unchanged():
  problem = selection.Problem(1024, 512, 256, BF16, 2, F32)
  assert problem.backward() == selection.Problem(1024, 256, 512, F32, 2,
                                                 BF16)
  assert selection.Problem(1024, 512, 256, BF16, 2).backward() == (
      selection.Problem(1024, 256, 512, BF16, 2, BF16))


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_the_plan_names_the_dtypes_it_runs(collective):
  problem = _problem((4096, 4096, 2048), 2, "e4m3_e4m3")
  plan = selection.choose("pallas", collective, problem, H200)
  assert plan.describe().startswith("pallas e4m3 x e4m3 -> bf16 ")
  assert plan.describe(backward=True).startswith("pallas bf16 ")
  assert plan.transposed().describe().startswith("pallas bf16 ")
  ring = selection.choose("ring", collective, problem, CPU)
  assert ring.describe() == "ring e4m3 x e4m3 -> bf16"
  # 16-bit plans say what they always said.
  bf16 = selection.choose("ring", collective, selection.Problem(
      4096, 4096, 2048, BF16, 2), CPU)
  assert bf16.describe() == "ring" and bf16.dtypes == ""


def test_cache_keys_name_both_fp8_dtypes():
  e4m3 = _problem((1024, 4096, 4096), 2, "e4m3_e4m3")
  e5m2 = _problem((1024, 4096, 4096), 2, "e5m2_e4m3")
  bf16 = selection.Problem(1024, 4096, 4096, BF16, 2)
  keys = {selection.cache_key(p, "NVIDIA H200") for p in (e4m3, e5m2, bf16)}
  assert keys == {"NVIDIA H200|float8_e4m3fn|D=2|1024x4096x4096",
                  "NVIDIA H200|float8_e5m2,float8_e4m3fn|D=2|1024x4096x4096",
                  "NVIDIA H200|bfloat16|D=2|1024x4096x4096"}


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_no_packaged_bf16_entry_serves_an_fp8_problem(collective):
  """Every packaged entry's shape, asked for with fp8 operands, gets the
  heuristics' fp8 config, not the bf16 entry."""
  served = 0
  for key in tuned.packaged_table():
    if tuned.key_collective(key) != collective:
      continue
    device_kind, dtype, axis, shape = key.split("|")[-4:]
    if dtype != "bfloat16":
      continue
    rows, k, n = map(int, shape.split("x"))
    device = selection.DeviceFacts("gpu", device_kind, 132)
    bf16 = selection.Problem(rows, k, n, BF16, int(axis[2:]))
    assert selection.config_for(collective, bf16, device)[1] == (
        selection.PACKAGED_TABLE)
    fp8 = bf16._replace(dtype=E4M3, out_dtype=BF16)
    config, source = selection.config_for(collective, fp8, device)
    assert source == selection.HEURISTIC and config.tile_k == 128
    served += 1
  assert served, "no packaged bf16 entry of this collective"


def _write_cache(path, entries):
  path.write_text(json.dumps(entries))


def test_an_autotuned_bf16_entry_never_serves_fp8(tmp_path):
  problem = _problem((1024, 4096, 4096), 2, "e4m3_e4m3")
  bf16 = selection.Problem(1024, 4096, 4096, BF16, 2)
  entry = kernels.AllGatherConfig(tile_m=64, tile_n=64, tile_k=64).to_json()
  _write_cache(tmp_path / "tuning.json",
               {selection.cache_key(bf16, "NVIDIA H200"): entry})
  assert selection.config_for("all_gather", bf16, H200) == (
      kernels.AllGatherConfig(tile_m=64, tile_n=64, tile_k=64),
      selection.AUTOTUNE_CACHE)
  config, source = selection.config_for("all_gather", problem, H200)
  assert source == selection.HEURISTIC and config.tile_k == 128


def test_an_fp8_entry_with_16_bit_k_steps_is_a_miss_and_a_good_one_is_used(
    tmp_path):
  problem = _problem((1024, 4096, 4096), 2, "e5m2_e4m3")
  key = selection.cache_key(problem, "NVIDIA H200", "reduce_scatter")
  bad = kernels.ReduceScatterConfig(tile_k=64)
  _write_cache(tmp_path / "tuning.json", {key: bad.to_json()})
  config, source = selection.config_for("reduce_scatter", problem, H200)
  assert source == selection.HEURISTIC and config.tile_k == 128
  good = kernels.ReduceScatterConfig(tile_k=128, max_concurrent_steps=3)
  _write_cache(tmp_path / "tuning.json", {key: good.to_json()})
  assert selection.config_for("reduce_scatter", problem, H200) == (
      good, selection.AUTOTUNE_CACHE)
