"""Rowwise-scaled problems through the selection (`Problem.rowwise`, the
rule `scales_reason`): not served by the Hopper kernels until their row
and column scales have passed on a GPU, so an explicit `pallas` falls back and `auto` runs XLA's GEMM on a Hopper GPU
(the portable fallback elsewhere), each with the reason recorded; the same
problem without row scales takes the kernels (the rule is what decides).

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
REASON = ("rowwise fp8 scales: not served by the Hopper kernels yet (their "
          "row and column scales have not passed on a GPU)")


@pytest.fixture(autouse=True)
def _command_buffers_off_no_cache(monkeypatch, tmp_path):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  monkeypatch.setenv("COLLECTIVE_MATMUL_TUNING_CACHE",
                     str(tmp_path / "tuning.json"))
  tuned._logged_misses.clear()  # pylint: disable=protected-access


def _problem(dtype, out, rowwise):
  return selection.Problem(4096, 4096, 2048, dtype, 2, out,
                           rowwise=rowwise)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("dtype,out", [(E4M3, F32), (E4M3, BF16),
                                       (BF16, None)], ids=str)
def test_pallas_falls_back_to_xla_on_hopper_with_the_reason(collective,
                                                            dtype, out):
  plan = selection.choose("pallas", collective, _problem(dtype, out, True),
                          H200)
  assert (plan.impl, plan.backward_impl) == (Impl.BASELINE, Impl.BASELINE)
  assert plan.is_fallback and REASON in plan.reason


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_auto_runs_xla_on_hopper_and_the_kernel_without_row_scales(
    collective):
  rowwise = selection.choose("auto", collective, _problem(E4M3, F32, True),
                             H200)
  assert rowwise.impl == Impl.BASELINE and not rowwise.is_fallback
  assert REASON in rowwise.reason
  per_tensor = selection.choose("auto", collective,
                                _problem(E4M3, F32, False), H200)
  assert per_tensor.impl == Impl.PALLAS


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
  assert selection.scales_reason(_problem(E4M3, F32, True)) == REASON
  assert selection.scales_reason(_problem(E4M3, F32, False)) is None
