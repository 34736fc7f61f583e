"""tools/plot_gemm_core.py: our cores' ratios to cuBLAS per shape, from
bench_gemm_core.py JSON (rows merged by shape over files)."""
import json

import pytest

from cm_test_utils import import_script

pytest.importorskip("matplotlib")


def _write(path, rows):
  with open(path, "w") as f:
    json.dump({"meta": {"jax": "0.11.2", "device": "NVIDIA H200"},
               "rows": rows}, f)
  return str(path)


def test_ratios_geomeans_and_rows_merged_by_shape(tmp_path):
  plot = import_script("plot_gemm_core")
  first = _write(tmp_path / "a.json", [
      {"shape": "1/2/3", "cublas_fp8_us": 100.0, "ours_fp8_us": 104.0,
       "ours_fp8_rs_us": 102.0},
      {"shape": "4/5/6", "cublas_fp8_us": 200.0, "ours_fp8_us": 999.0}])
  # A later call re-timed 4/5/6: its row replaces the first file's.
  second = _write(tmp_path / "b.json", [
      {"shape": "4/5/6", "cublas_fp8_us": 200.0, "ours_fp8_us": 202.0,
       "cublas_us": 400.0, "ours_ag_us": 404.0, "ours_fp8_pp_us": 190.0,
       "ours_pp_us": 396.0, "ours_pp_rounds_us": [396.0]}])
  rows, meta = plot.merged_rows([first, second])
  assert [r["shape"] for r in rows] == ["1/2/3", "4/5/6"]
  assert meta["device"] == "NVIDIA H200"
  got = plot.ratios(rows)
  # Then the --variant arms, each against its dtype's cuBLAS.
  assert list(got) == ["bf16 all-gather core / cuBLAS",
                       "fp8 all-gather core / cuBLASLt fp8",
                       "fp8 reduce-scatter core / cuBLASLt fp8",
                       "ours_fp8_pp / cuBLASLt fp8", "ours_pp / cuBLAS"]
  assert got["ours_fp8_pp / cuBLASLt fp8"] == [None, 0.95]
  assert got["ours_pp / cuBLAS"] == [None, 0.99]
  assert got["bf16 all-gather core / cuBLAS"] == [None, 1.01]
  assert got["fp8 all-gather core / cuBLASLt fp8"] == pytest.approx(
      [1.04, 1.01])
  assert plot.geomean(got["fp8 all-gather core / cuBLASLt fp8"]) == (
      pytest.approx((1.04 * 1.01) ** 0.5))
  assert plot.geomean(got["bf16 all-gather core / cuBLAS"]) == (
      pytest.approx(1.01))
  out = tmp_path / "core.png"
  plot.main([first, second], str(out))
  assert out.read_bytes().startswith(b"\x89PNG")


def test_work_outside_our_kernel_is_its_share(tmp_path):
  plot = import_script("plot_gemm_core")
  src = _write(tmp_path / "a.json", [
      {"shape": "1/2/3", "cublas_fp8_us": 100.0, "ours_fp8_us": 100.0,
       "ours_fp8_kernels": {"anonymous_mosaic_gpu_kernel": 100.0},
       "ours_fp8_pp_us": 150.0,
       "ours_fp8_pp_kernels": {"loop_pad_fusion": 10.0,
                               "anonymous_mosaic_gpu_kernel": 110.0,
                               "loop_slice_fusion": 30.0}}])
  rows, _ = plot.merged_rows([src])
  assert plot.kernel_share(rows[0], "ours_fp8") == 1.0
  assert plot.kernel_share(rows[0], "ours_fp8_pp") == pytest.approx(110 / 150)
  assert plot.kernel_share(rows[0], "ours_fp8_rs") is None
  assert plot.shares(rows)["ours_fp8_pp / cuBLASLt fp8"] == [
      pytest.approx(110 / 150)]
  out = tmp_path / "core.png"
  plot.main([src], str(out))
  assert out.read_bytes().startswith(b"\x89PNG")


def test_a_json_without_any_ratio_is_refused(tmp_path):
  plot = import_script("plot_gemm_core")
  src = _write(tmp_path / "a.json", [{"shape": "1/2/3", "cublas_us": 1.0}])
  with pytest.raises(SystemExit, match="no row has both times"):
    plot.main([src], str(tmp_path / "x.png"))
