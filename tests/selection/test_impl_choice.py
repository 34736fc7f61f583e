"""Which implementation `auto` (and an explicit `pallas`) picks, per pattern.

The choice depends only on global facts (platform, device kind, dtype,
local sizes, flags), so it is checked here with meshes that *describe*
Hopper GPUs; nothing runs on them.
"""
import dataclasses

import jax.numpy as jnp
import pytest

import collective_matmul as cm
from collective_matmul import override
from collective_matmul import patterns


@dataclasses.dataclass
class _Device:
  platform: str
  device_kind: str
  num_cores: int = 132


@dataclasses.dataclass
class _Mesh:
  abstract_device: _Device
  axis_names: tuple = ("data", "tensor")
  axis_sizes: tuple = (1, 2)


@pytest.fixture(autouse=True)
def _command_buffers_off(monkeypatch):
  """XLA command buffers off, so the decision does not depend on whether
  this JAX is checked under them (see
  selection.command_buffer_reason); tests of that rule set XLA_FLAGS again."""
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")


HOPPER = _Mesh(_Device("gpu", "NVIDIA H200"))
AMPERE = _Mesh(_Device("gpu", "NVIDIA A100-SXM4-80GB"))
CPU = _Mesh(_Device("cpu", "cpu"))


def _all_gather(rows, k, n):
  """x[rows*2, k] rows on tensor, w[k, n*2] columns on tensor (global)."""
  lhs, rhs = jnp.zeros((2 * rows, k), jnp.bfloat16), jnp.zeros(
      (k, 2 * n), jnp.bfloat16)
  dims = (((1,), (0,)), ((), ()))
  match = patterns.match_all_gather_matmul(
      lhs.shape, rhs.shape, dims, (("tensor",), ()), ((), ("tensor",)),
      {"data": 1, "tensor": 2})
  assert isinstance(match, patterns.AllGatherMatch)
  return match, lhs, rhs, dims


def _reduce_scatter(rows, k, n):
  """h[rows*2, k*2] contraction on tensor, result rows on tensor."""
  lhs, rhs = jnp.zeros((2 * rows, 2 * k), jnp.bfloat16), jnp.zeros(
      (2 * k, n), jnp.bfloat16)
  dims = (((1,), (0,)), ((), ()))
  match = patterns.match_matmul_reduce_scatter(
      lhs.shape, rhs.shape, dims, ((), ("tensor",)), (("tensor",), ()),
      {"data": 1, "tensor": 2}, (("tensor",), ()))
  assert isinstance(match, patterns.ReduceScatterMatch)
  return match, lhs, rhs, dims


def _choose(cfg, case, mesh):
  match, lhs, rhs, dims = case
  plan = override.choose_plan(cfg, match, lhs, rhs, dims, mesh, None)
  return plan.impl, plan.backward_impl, plan.reason, plan.is_fallback


@pytest.mark.parametrize("case", [_all_gather, _reduce_scatter])
def test_auto_takes_both_kernels_on_hopper_for_large_problems(case):
  impl, bwd, reason, fallback = _choose(
      cm.CollectiveMatmulConfig(enabled=True), case(4096, 4096, 4096), HOPPER)
  assert (impl, bwd, reason, fallback) == ("pallas", "pallas", "", False)


@pytest.mark.parametrize("case", [_all_gather, _reduce_scatter])
def test_auto_takes_xla_for_problems_too_small_to_overlap(case):
  impl, bwd, reason, fallback = _choose(
      cm.CollectiveMatmulConfig(enabled=True), case(64, 4096, 4096), HOPPER)
  assert (impl, bwd, fallback) == ("baseline", "baseline", False)
  assert "tiles per ring step" in reason


@pytest.mark.parametrize("case", [_all_gather, _reduce_scatter])
def test_auto_overlaps_small_problems_where_measured_faster(case):
  # 256 rows per shard at D = 2 (runs 27-28: the all-gather 34.2 against
  # 49.9 us for NCCL + cuBLAS, the reduce-scatter 36.7 against 46.6).
  impl, bwd, reason, fallback = _choose(
      cm.CollectiveMatmulConfig(enabled=True), case(256, 4096, 4096), HOPPER)
  assert (impl, bwd, reason, fallback) == ("pallas", "pallas", "", False)


def test_explicit_pallas_still_runs_a_small_problem():
  impl, _, _, fallback = _choose(
      cm.CollectiveMatmulConfig(enabled=True, impl="pallas"),
      _all_gather(256, 1024, 1024), HOPPER)
  assert (impl, fallback) == ("pallas", False)


@pytest.mark.parametrize("mesh,needle", [(AMPERE, "not a Hopper"),
                                         (CPU, "backend is 'cpu'")])
def test_no_hopper_means_the_fallback_and_a_reason(mesh, needle):
  cfg = cm.CollectiveMatmulConfig(enabled=True)
  impl, bwd, reason, fallback = _choose(cfg, _all_gather(4096, 4096, 4096),
                                        mesh)
  assert (impl, bwd, fallback) == ("ring", "ring", False)
  assert needle in reason
  forced = dataclasses.replace(cfg, impl="pallas", fallback_impl="baseline")
  impl, _, _, fallback = _choose(forced, _all_gather(4096, 4096, 4096), mesh)
  assert (impl, fallback) == ("baseline", True)  # Strict mode would raise.


def test_switching_the_reduce_scatter_kernel_off_reaches_the_backward():
  cfg = cm.CollectiveMatmulConfig(enabled=True, reduce_scatter_kernel=False)
  # The all-gather kernel's backward is a matmul + reduce-scatter.
  assert _choose(cfg, _all_gather(4096, 4096, 4096), HOPPER)[:2] == (
      "pallas", "baseline")
  impl, _, reason, _ = _choose(cfg, _reduce_scatter(4096, 4096, 4096), HOPPER)
  assert impl == "baseline" and "switched off" in reason


@pytest.mark.parametrize("impl", ["ring", "baseline"])
def test_forced_portable_impls_serve_both_directions(impl):
  cfg = cm.CollectiveMatmulConfig(enabled=True, impl=impl)
  assert _choose(cfg, _reduce_scatter(4096, 4096, 4096), HOPPER) == (
      impl, impl, "", False)


@pytest.mark.parametrize("impl", ["auto", "pallas"])
@pytest.mark.parametrize("case", [_all_gather, _reduce_scatter])
def test_custom_calls_in_unchecked_command_buffers_fall_back_to_xla(
    impl, case, monkeypatch):
  # XLA's default set captures custom calls; a JAX whose kernels were not
  # checked under capture gets NCCL + cuBLAS, with the fix in the reason.
  from collective_matmul.selection import applicability
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  monkeypatch.setattr(applicability, "_jax_version", lambda: (0, 10))
  chosen, backward, reason, is_fallback = _choose(
      cm.CollectiveMatmulConfig(enabled=True, impl=impl),
      case(8192, 4096, 4096), HOPPER)
  assert (chosen, backward) == ("baseline", "baseline")
  assert "command buffers" in reason and "JAX 0.10" in reason
  assert "--xla_gpu_enable_command_buffer=-CUSTOM_CALL" in reason
  assert is_fallback == (impl == "pallas")


@pytest.mark.parametrize("case", [_all_gather, _reduce_scatter])
def test_checked_jax_keeps_the_kernel_under_xla_s_default_flags(
    case, monkeypatch):
  from collective_matmul.selection import applicability
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  monkeypatch.setattr(applicability, "_jax_version", lambda: (0, 12))
  chosen, backward, reason, _ = _choose(
      cm.CollectiveMatmulConfig(enabled=True, impl="auto"),
      case(8192, 4096, 4096), HOPPER)
  assert (chosen, backward) == ("pallas", "pallas"), reason


@pytest.mark.parametrize("case", [_all_gather, _reduce_scatter])
def test_a_ring_across_processes_falls_back_to_xla_with_the_reason(
    case, monkeypatch):
  # One process per GPU: the path that fails on NCCL 2.28.9 (BUILD.md).
  monkeypatch.setattr(override.jax, "process_count", lambda: 2)
  monkeypatch.setattr(override.jax, "local_device_count", lambda: 1)
  chosen, backward, reason, _ = _choose(
      cm.CollectiveMatmulConfig(enabled=True, impl="auto"),
      case(8192, 4096, 4096), HOPPER)
  assert (chosen, backward) == ("baseline", "baseline")
  assert "spans several processes" in reason


def test_one_process_owning_the_whole_ring_keeps_the_kernel(monkeypatch):
  monkeypatch.setattr(override.jax, "process_count", lambda: 2)
  monkeypatch.setattr(override.jax, "local_device_count", lambda: 8)
  chosen, _, reason, _ = _choose(
      cm.CollectiveMatmulConfig(enabled=True, impl="auto"),
      _all_gather(8192, 4096, 4096), HOPPER)
  assert chosen == "pallas", reason
