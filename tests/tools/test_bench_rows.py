"""What the benchmark scripts record per shape, on CPU: the Hopper kernels
replaced by plain matmuls and CUPTI by a call of the function, so the rows'
keys, configs, error checks and reports run without a GPU (the GPU runs
themselves are under benchmarks/)."""
import argparse
import functools
import types

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from cm_test_utils import import_script


def _run_once(f, *operands, iterations):
  del iterations
  return jax.block_until_ready(f(*operands)), 2.0, {"fake": 2.0}


def _product(a, b, layout, scale, row_scale=None, col_scale=None):
  """a @ b (b given [n, k] where `layout` is "nk"), fp8 operands in f32,
  times `scale` and the row and column scales, in bf16 as the kernels'
  fp8 cores give it."""
  if layout == "kn" and scale is row_scale is col_scale is None:
    return a @ b
  out = lax.dot_general(a, b, (((1,), (1 if layout == "nk" else 0,)),
                               ((), ())),
                        preferred_element_type=jnp.float32)
  if row_scale is not None:
    out = out * row_scale[:, None]
  if col_scale is not None:
    out = out * col_scale[None, :]
  return (out * (1 if scale is None else scale)).astype(jnp.bfloat16)


def _fake_all_gather_kernel(a, b, axis_name, *, config, weight_layout="kn",
                            scale=None, row_scale=None, col_scale=None):
  del config
  if row_scale is not None:
    row_scale = lax.all_gather(row_scale, axis_name, axis=0, tiled=True)
  return _product(lax.all_gather(a, axis_name, axis=0, tiled=True), b,
                  weight_layout, scale, row_scale, col_scale)


def _fake_reduce_scatter_kernel(a, b, axis_name, *, config, weight_layout="kn",
                                scale=None, row_scale=None, col_scale=None):
  del config
  return lax.psum_scatter(
      _product(a, b, weight_layout, scale, row_scale, col_scale), axis_name,
      scatter_dimension=0, tiled=True)


def _fake_kernels(real):
  return types.SimpleNamespace(
      AllGatherConfig=real.AllGatherConfig,
      ReduceScatterConfig=real.ReduceScatterConfig,
      all_gather_lhs_matmul=_fake_all_gather_kernel,
      matmul_reduce_scatter=_fake_reduce_scatter_kernel)


@pytest.fixture
def gemm_core(monkeypatch):
  bench = import_script("bench_gemm_core")
  monkeypatch.setattr(bench, "kernel_time_us", _run_once)
  monkeypatch.setattr(bench, "kernels", _fake_kernels(bench.kernels))
  return bench


def test_gemm_core_row_records_each_config_and_the_variants_that_fail(
    gemm_core):
  args = argparse.Namespace(
      iterations=1, rounds=2, skip_upstream=True, power_seconds=0,
      trace_dir=None, skip_fp8=True, rowwise=False, only=None,
      variant=[gemm_core.parse_variant('w256={"tile_m": 64, "tile_n": 256, '
                                       '"wg_dimension": "m"}'),
               gemm_core.parse_variant('rs_bad={"tile_m": 7}')])
  row = gemm_core.bench("256/512/256", args)
  for name in ("cublas", "ours_ag", "ours_rs", "ours_w256"):
    assert row[f"{name}_rel_err"] < 1e-2, name
    assert row[f"{name}_rounds_us"] == [2.0, 2.0]
  # The all-gather core runs without senders but records the ring's pick.
  core, picked = gemm_core.core_ag_config(256, 512, 256)
  assert row["ours_ag_config"] == gemm_core.dataclasses.asdict(picked)
  assert core.sender_sms == 0
  assert row["ours_w256_config"]["tile_n"] == 256
  assert "tile_m=7" in row["ours_rs_bad_error"]
  assert "ours_rs_bad_us" not in row
  assert not [key for key in row if "fp8" in key]


def test_gemm_core_row_records_the_fp8_arms_beside_the_bf16_ones(
    gemm_core, monkeypatch):
  """cuBLASLt's fp8 GEMM on e4m3 and e5m2 operands and our two fp8 cores,
  each checked against the f32 product of its fp8 values, at selection's
  fp8 picks (here the bf16 core's config with tile_k 128); fp8_* /
  rs_fp8_* variants on top; with --fp8-forward the forward from bf16
  operands through Flax's quantization, XLA's and the op's (the portable
  ring on CPU), against the f32 product of the quantized values."""
  monkeypatch.setattr(gemm_core, "fp8_forward_arms", functools.partial(
      gemm_core.fp8_forward_arms, impl="ring"))
  args = argparse.Namespace(
      iterations=1, rounds=2, skip_upstream=True, power_seconds=0,
      trace_dir=None, skip_fp8=False, fp8_forward=True, rowwise=False,
      only=None,
      variant=[gemm_core.parse_variant('fp8_deep={"max_concurrent_steps": '
                                       '3}'),
               gemm_core.parse_variant('rs_fp8_bad={"tile_k": 48}')])
  row = gemm_core.bench("256/512/256", args)
  for name in ("cublas", "ours_ag", "ours_rs", "cublas_fp8", "cublas_fp8_rs",
               "ours_fp8", "ours_fp8_rs", "ours_fp8_deep"):
    assert row[f"{name}_rel_err"] < 1e-2, name
    assert row[f"{name}_rounds_us"] == [2.0, 2.0], name
  assert row["ours_fp8_config"]["tile_k"] == 128
  assert row["ours_fp8_deep_config"]["max_concurrent_steps"] == 3
  assert row["ours_fp8_rs_config"] == dict(
      row["ours_rs_config"], tile_k=128)
  assert "tile_k" in row["ours_rs_fp8_bad_error"]
  assert "ours_rs_fp8_bad_us" not in row
  for name in ("xla_fp8_fwd", "ours_fp8_fwd"):
    assert row[f"{name}_rel_err"] < 1e-2, name
    assert row[f"{name}_rounds_us"] == [2.0, 2.0], name


def test_gemm_core_row_records_the_rowwise_arms_beside_the_per_tensor_ones(
    gemm_core):
  """With --rowwise, XLA's fp8 GEMM and our two fp8 cores scaled by row
  and column vectors, at the per-tensor cores' configs, each checked
  against the f32 product of its fp8 values times the vectors: a core
  that dropped them (here: the column scales) is reported wrong."""
  args = argparse.Namespace(
      iterations=1, rounds=1, skip_upstream=True, power_seconds=0,
      trace_dir=None, skip_fp8=False, fp8_forward=False, rowwise=True,
      only=None, variant=[])
  row = gemm_core.bench("256/512/256", args)
  for name in gemm_core.ROWWISE_ARMS + ("ours_fp8", "cublas_fp8"):
    assert row[f"{name}_rel_err"] < 1e-2, name
  assert row["ours_fp8_rowwise_config"] == row["ours_fp8_config"]
  assert row["ours_fp8_rs_rowwise_config"] == row["ours_fp8_rs_config"]
  real = gemm_core.kernels.all_gather_lhs_matmul
  gemm_core.kernels.all_gather_lhs_matmul = (
      lambda *a, col_scale=None, **kw: real(*a, **kw))
  row = gemm_core.bench("256/512/256", args)
  assert row["ours_fp8_rowwise_rel_err"] > 0.1
  assert row["ours_fp8_rs_rowwise_rel_err"] < 1e-2


def _kernels_args(**kw):
  base = dict(iterations=1, rounds=1, skip_seed=True, windowed=False,
              trace_dir=None, trace_warmups=1, config=[], rs_config=[])
  base.update(kw)
  return argparse.Namespace(**base)


@pytest.fixture
def bench_kernels(monkeypatch):
  bench = import_script("bench_kernels")
  monkeypatch.setattr(bench, "kernel_time_us", _run_once)
  monkeypatch.setattr(bench, "kernels", _fake_kernels(bench.kernels))
  # What impl="pallas" runs: the (faked) kernel.
  real_cm = bench.cm

  def all_gather_matmul(a, b, axis_name, *, impl, kernel_config=None):
    if impl == "pallas":
      return _fake_all_gather_kernel(a, b, axis_name, config=kernel_config)
    return real_cm.all_gather_matmul(a, b, axis_name, impl=impl)

  monkeypatch.setattr(bench, "cm", types.SimpleNamespace(
      all_gather_matmul=all_gather_matmul))
  return bench


def test_all_gather_row_checks_every_method_against_f32(bench_kernels):
  k = bench_kernels.kernels
  args = _kernels_args(config=[
      bench_kernels.parse_config(k.AllGatherConfig,
                                 '{"selected": true, "tile_n": 64}'),
      bench_kernels.parse_config(k.AllGatherConfig,
                                 '{"selected": true, "tile_n": 5}')])
  row = bench_kernels.bench_shape(64, 128, 64, "bf16", args)
  d = jax.device_count()
  assert row["D"] == d and row["shape"] == "64/128/64"
  for key in ("nccl", "ours", "ours_cfg1", "ring"):
    assert row[f"{key}_rel_err"] < 1e-2, key
  assert row["ours_repeat_identical"] and row["ours_cfg1_config"]["tile_n"] == 64
  assert row["bound_us"] == 2.0 * d  # D x the local GEMM.
  assert "tile_n=5" in row["ours_cfg2_error"]
  assert row["ours_tflops"] == 2 * d * 64 * 128 * 64 / 2.0 / 1e6


def test_reduce_scatter_row_checks_against_f32_and_marks_loopback(
    bench_kernels):
  k = bench_kernels.kernels
  args = _kernels_args(rs_config=[bench_kernels.parse_config(
      k.ReduceScatterConfig, '{"selected": true, "loopback": true}')])
  row = bench_kernels.bench_reduce_scatter(64, 128, 64, "f16", args)
  assert row["pattern"] == "reduce_scatter" and row["dtype"] == "f16"
  assert row["ours_rel_err"] < 1e-2 and row["nccl_rel_err"] < 1e-2
  assert row["ours_cfg1_loopback"] and "ours_loopback" not in row
  assert row["ours_config"] == row["ours_cfg1_config"]


@pytest.mark.parametrize("pattern", ["all_gather", "reduce_scatter"])
def test_fp8_row_checks_every_arm_against_the_scaled_f32_product(
    monkeypatch, pattern):
  """An `m/k/n:fp8` shape: XLA's fp8 GEMM alone (x D), on every device,
  after its collective, and the op at each config (here the portable
  ring's plan, as the kernel needs a GPU), each against the f32 product
  of the same fp8 values times the scale; a loopback config is marked, a
  broken one reported, and a plan that would fall back to XLA is never
  timed as ours."""
  bench = import_script("bench_kernels")
  monkeypatch.setattr(bench, "kernel_time_us", _run_once)
  monkeypatch.setattr(bench, "kernels", _fake_kernels(bench.kernels))
  monkeypatch.setattr(bench, "pallas_plan", lambda pattern, problem, device,
                      config: bench.selection.choose("ring", pattern,
                                                     problem, device))
  config_class = (bench.kernels.AllGatherConfig if pattern == "all_gather"
                  else bench.kernels.ReduceScatterConfig)
  parsed = [bench.parse_config(config_class,
                               '{"selected": true, "loopback": true}'),
            bench.parse_config(config_class,
                               '{"selected": true, "tile_m": 7}')]
  args = _kernels_args(config=parsed, rs_config=parsed)
  row = bench.bench_fp8(pattern, 64, 128, 64, args)
  d = jax.device_count()
  assert row["dtype"] == "fp8" and row["pattern"] == pattern
  assert row["dtypes"].startswith("float8_e4m3fn" if pattern == "all_gather"
                                  else "float8_e5m2")
  for key in ("bound", "nccl", "ours", "ring"):
    if key != "bound":
      assert row[f"{key}_rel_err"] < 1e-2, key
  # As the bf16 runs: D x a shard's GEMM, or the local contraction's one.
  assert row["bound_us"] == 2.0 * (d if pattern == "all_gather" else 1)
  assert row["ours_config"]["tile_k"] == 128 and row["ours_repeat_identical"]
  assert row["ours_cfg1_loopback"] and "ours_cfg1_rel_err" not in row
  assert "tile_m=7" in row["ours_cfg2_error"]


def test_fp8_ours_is_never_xla_s_fallback():
  """Where the kernel cannot run (here: a CPU; on a GPU a config fp8
  cannot take), the fp8 arm is an error, not the baseline timed under our
  name."""
  bench = import_script("bench_kernels")
  tile_k64 = bench.parse_config(bench.kernels.AllGatherConfig,
                                '{"selected": true, "tile_k": 64}')
  arms = {key: config for key, _, config, _ in bench.fp8_arms(
      "all_gather", 64, 128, 64, 2, [tile_k64])}
  assert isinstance(arms["ours"], ValueError)
  assert "does not run here" in str(arms["ours"])
  h200 = {key: config for key, _, config, _ in bench.fp8_arms(
      "all_gather", 64, 128, 64, 2, [tile_k64],
      bench.bench_plan.planned_device(132, 2))}
  assert h200["ours"].tile_k == 128
  assert "tile_k=64 with fp8" in str(h200["ours_cfg1"])
