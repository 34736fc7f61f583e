"""The plan carries how the kernels take their operands: the weight's
layout (K-major for fp8) and the rows' (each run addressed where the
config's tiles fit it, else the split dimension moved first), for the
forward and the backward, decided once by `selection.choose`."""
import jax.numpy as jnp
import numpy as np
import pytest

from collective_matmul import plan as plan_lib
from collective_matmul import selection
from collective_matmul.enums import Collective
from collective_matmul.enums import RowLayout
from collective_matmul.enums import WeightLayout

BF16, E4M3 = np.dtype(jnp.bfloat16), np.dtype(jnp.float8_e4m3fn)
H200 = selection.DeviceFacts("gpu", "NVIDIA H200", 132)


@pytest.fixture(autouse=True)
def _command_buffers_off_no_cache(monkeypatch, tmp_path):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  monkeypatch.setenv("COLLECTIVE_MATMUL_TUNING_CACHE",
                     str(tmp_path / "none.json"))


def _choose(collective, dtype, rows_per_batch=None, impl="pallas"):
  problem = selection.Problem(4096, 4096, 4096, dtype, 2,
                              BF16 if dtype == E4M3 else None,
                              rows_per_batch=rows_per_batch)
  return selection.choose(impl, collective, problem, H200)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_fp8_weights_go_to_the_kernel_k_major_and_the_bf16_backward_not(
    collective):
  plan = _choose(collective, E4M3)
  assert plan.impl == plan.backward_impl == "pallas"
  assert plan.weight_layout == WeightLayout.NK
  assert plan.backward_weight_layout == WeightLayout.KN
  assert _choose(collective, BF16).weight_layout == WeightLayout.KN


@pytest.mark.parametrize("impl", ["ring", "baseline"])
def test_the_portable_impls_take_no_layouts(impl):
  plan = _choose("all_gather", E4M3, rows_per_batch=40, impl=impl)
  assert (plan.row_layout, plan.weight_layout, plan.backward_row_layout,
          plan.backward_weight_layout) == (None,) * 4


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_runs_of_rows_the_tiles_fit_are_addressed_as_given(collective):
  plan = _choose(collective, BF16, rows_per_batch=None)
  assert plan.row_layout == plan.backward_row_layout == RowLayout.AS_GIVEN
  fits = plan.config.cta_tile_m * 2
  plan = _choose(collective, BF16, rows_per_batch=fits)
  assert plan.row_layout == RowLayout.AS_GIVEN
  # A run of 40 rows fits no tile: the split dimension goes first.
  plan = _choose(collective, BF16, rows_per_batch=40)
  assert plan.row_layout == plan.backward_row_layout == RowLayout.AXIS_FIRST


def test_the_backward_plan_takes_the_backward_layouts():
  plan = _choose("all_gather", E4M3, rows_per_batch=40)
  back = plan.transposed()
  assert (back.weight_layout, back.backward_weight_layout) == (
      plan.backward_weight_layout, plan.weight_layout)
  assert back.transposed() == plan


@pytest.mark.parametrize("collective,shape,axis,want", [
    (Collective.ALL_GATHER, (4, 40, 64), 0, (160, None)),
    (Collective.ALL_GATHER, (4, 40, 64), 1, (160, 40)),
    # The reduce-scatter's kernel sees the rows after the scatter (D = 2).
    (Collective.REDUCE_SCATTER, (4, 80, 64), 1, (160, 40)),
    (Collective.REDUCE_SCATTER, (8, 40, 64), 0, (160, None)),
])
def test_kernel_rows_are_the_rows_and_runs_the_kernel_sees(collective, shape,
                                                           axis, want):
  assert plan_lib.kernel_rows(collective, shape, axis, 2) == want
