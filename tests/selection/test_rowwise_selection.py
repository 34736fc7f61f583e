"""Rowwise-scaled problems through the selection (`Problem.rowwise`, the
rule `scales_reason`): with fp8 operands, the pairs whose row and column
scales passed on a GPU, `auto` and `pallas` take the Hopper kernels as for
per-tensor fp8; with bf16 operands an explicit `pallas` falls back and
`auto` runs XLA's GEMM on a Hopper GPU (the portable fallback elsewhere),
each with the reason recorded.

Decisions only: nothing runs on the Hopper GPU described here.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from collective_matmul import selection
from collective_matmul.enums import Impl
from collective_matmul.selection import tuned

E4M3, BF16, F32 = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.bfloat16),
                   np.dtype(jnp.float32))
H200 = selection.DeviceFacts("gpu", "NVIDIA H200", 132)
CPU = selection.DeviceFacts("cpu", "cpu", 1)
REASON = ("row and column scales with non-fp8 operands: not served by the "
          "Hopper kernels (they have run on a GPU with fp8 operands only)")


@pytest.fixture(autouse=True)
def _command_buffers_off_no_cache(monkeypatch, tmp_path):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  monkeypatch.setenv("COLLECTIVE_MATMUL_TUNING_CACHE",
                     str(tmp_path / "tuning.json"))
  tuned._logged_misses.clear()  # pylint: disable=protected-access


def _problem(dtype, out, rowwise):
  return selection.Problem(4096, 4096, 2048, dtype, 2, out,
                           rowwise=rowwise)


@pytest.mark.parametrize("requested", ["auto", "pallas"])
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("out", [F32, BF16], ids=str)
def test_fp8_rowwise_takes_the_kernels_on_hopper_as_per_tensor(
    requested, collective, out):
  rowwise = selection.choose(requested, collective,
                             _problem(E4M3, out, True), H200)
  per_tensor = selection.choose(requested, collective,
                                _problem(E4M3, out, False), H200)
  assert rowwise.impl == per_tensor.impl == Impl.PALLAS
  assert not rowwise.is_fallback
  assert rowwise.config == per_tensor.config
  assert rowwise.dtypes.endswith(" rowwise")


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_bf16_rowwise_falls_back_to_xla_on_hopper_with_the_reason(
    collective):
  plan = selection.choose("pallas", collective, _problem(BF16, None, True),
                          H200)
  assert (plan.impl, plan.backward_impl) == (Impl.BASELINE, Impl.BASELINE)
  assert plan.is_fallback and REASON in plan.reason
  auto = selection.choose("auto", collective, _problem(BF16, None, True),
                          H200)
  assert auto.impl == Impl.BASELINE and not auto.is_fallback
  assert REASON in auto.reason
  assert selection.choose("auto", collective, _problem(BF16, None, False),
                          H200).impl == Impl.PALLAS


def test_off_hopper_auto_runs_the_configured_fallback():
  plan = selection.choose("auto", "all_gather", _problem(E4M3, F32, True),
                          CPU, selection.Options(fallback_impl=Impl.RING))
  assert plan.impl == Impl.RING


def test_the_plan_names_rowwise_forward_and_backward():
  plan = selection.choose("ring", "all_gather", _problem(E4M3, F32, True),
                          CPU)
  assert plan.dtypes == "e4m3 x e4m3 -> f32 rowwise"
  assert plan.backward_dtypes.endswith(" rowwise")
  assert _problem(E4M3, F32, True).backward().rowwise
  assert "rowwise" in plan.describe()


def test_the_rule_is_one_place():
  assert selection.scales_reason(_problem(BF16, None, True)) == REASON
  assert selection.scales_reason(_problem(BF16, None, False)) is None
  assert selection.scales_reason(_problem(E4M3, F32, True)) is None
