"""The two environment rules of `auto`: XLA's command-buffer set (read as
XLA reads `--xla_gpu_enable_command_buffer`) and the NCCL a ring across
processes needs (the version the processes loaded, the lowest of the job).
"""
import ctypes

import pytest

from collective_matmul import selection
from collective_matmul.selection import applicability
from collective_matmul.selection import device as device_lib

FLAG = selection.COMMAND_BUFFER_FLAG
DEFAULT = selection.applicability.DEFAULT_COMMAND_BUFFER_TYPES


@pytest.mark.parametrize("flags,types", [
    ("", DEFAULT),
    ("--xla_force_host_platform_device_count=8", DEFAULT),
    (f"{FLAG}", set()),
    (f"--a=1 {FLAG} --b=2", set()),
    (f"{FLAG}FUSION,CUBLAS", {"FUSION", "CUBLAS"}),
    (f'{FLAG}"fusion, cublas"', {"FUSION", "CUBLAS"}),
    (f"{FLAG}fusion,", {"FUSION"}),
    (f"{FLAG}'FUSION,CUBLAS'", {"FUSION", "CUBLAS"}),
    (f"{FLAG}-CUSTOM_CALL", DEFAULT - {"CUSTOM_CALL"}),
    (f"{FLAG}+FUSION", DEFAULT),
    (f"{FLAG}-CUSTOM_CALL,-FUSION", DEFAULT - {"CUSTOM_CALL", "FUSION"}),
    (f"{FLAG}+WHILE", DEFAULT | {"WHILE"}),
    # Each occurrence applies to what the ones before left, in order.
    (f"{FLAG} {FLAG}FUSION", {"FUSION"}),
    (f"{FLAG}FUSION {FLAG}+CUSTOM_CALL", {"FUSION", "CUSTOM_CALL"}),
    (f"{FLAG}FUSION,CUSTOM_CALL {FLAG}-CUSTOM_CALL", {"FUSION"}),
    (f"{FLAG}FUSION {FLAG}", set()),
])
def test_the_command_buffer_set_is_read_as_xla_reads_it(flags, types):
  assert selection.command_buffer_types(flags) == frozenset(types)


@pytest.mark.parametrize("value,says", [
    ("FUSION,-CUBLAS", "all values must be incremental"),
    ("+FUSION,", "all values must be incremental"),
    ("FUS;ION", "'FUS;ION' is no command type name"),
    ("-", "'' is no command type name"),
    ("'CUSTOM CALL'", "'CUSTOM CALL' is no command type name"),
])
def test_a_malformed_command_buffer_value_is_a_clear_error(value, says):
  with pytest.raises(ValueError, match="XLA_FLAGS") as raised:
    selection.command_buffer_reason("gpu", f"{FLAG}{value}", (0, 12))
  assert says in str(raised.value)


@pytest.mark.parametrize("flags", [
    f"{FLAG}", f"{FLAG}FUSION,CUBLAS", f"{FLAG}-CUSTOM_CALL",
    f"{FLAG}FUSION,CUSTOM_CALL {FLAG}-CUSTOM_CALL"])
def test_a_set_without_custom_calls_keeps_the_kernels_on_any_jax(flags):
  assert selection.command_buffer_reason("gpu", flags, (0, 10)) is None


@pytest.mark.parametrize("flags", [
    "", f"{FLAG}FUSION,CUSTOM_CALL", f"{FLAG}+FUSION",
    f"{FLAG} {FLAG}+CUSTOM_CALL"])
def test_captured_custom_calls_are_refused_only_on_unchecked_jax(flags):
  for version in selection.CAPTURE_CHECKED_JAX:
    assert selection.command_buffer_reason("gpu", flags, version) is None
  reason = selection.command_buffer_reason("gpu", flags, (0, 10))
  assert "JAX 0.10" in reason and "0.11, 0.12" in reason
  assert f"{FLAG}-CUSTOM_CALL" in reason
  # Off a GPU the flags do not matter (XLA_FLAGS is not even parsed).
  assert selection.command_buffer_reason("cpu", f"{FLAG}a;b", (0, 10)) is None


# ------------------------------------------------------------------ NCCL


def _problem(axis_size=2):
  import numpy as np  # pylint: disable=g-import-not-at-top
  return selection.Problem(4096, 4096, 4096, np.dtype("bfloat16"), axis_size)


def _facts(nccl, processes=2, local=1):
  return selection.DeviceFacts("gpu", "NVIDIA H100 80GB HBM3", 132,
                               processes, local, nccl)


@pytest.mark.parametrize("nccl", [(2, 29, 2), (2, 30, 7), (2, 32, 6),
                                  (3, 0, 0)])
def test_a_ring_across_processes_runs_from_nccl_2_29_2(nccl):
  assert selection.process_layout_reason(_problem(), _facts(nccl)) is None


@pytest.mark.parametrize("nccl,says", [
    ((2, 28, 9), "NCCL 2.28.9"), ((2, 29, 1), "NCCL 2.29.1"),
    (None, "NCCL version unknown")])
def test_older_or_unknown_nccl_refuses_the_ring_naming_it_and_the_fix(
    nccl, says):
  reason = selection.process_layout_reason(_problem(), _facts(nccl))
  assert says in reason and "spans several processes" in reason
  assert 'pip install "nvidia-nccl-cu13>=2.30"' in reason


def test_one_process_owning_the_ring_needs_no_nccl_peer_pointer():
  assert selection.process_layout_reason(
      _problem(4), _facts(None, processes=2, local=4)) is None
  assert selection.process_layout_reason(
      _problem(4), _facts(None, processes=1, local=4)) is None


@pytest.mark.parametrize("code,version", [
    (23206, (2, 32, 6)), (22809, (2, 28, 9)), (22902, (2, 29, 2)),
    (2804, (2, 8, 4))])
def test_nccl_version_codes_decode_both_encodings(code, version):
  assert device_lib._decode_nccl_version(code) == version  # pylint: disable=protected-access


def test_the_mapped_libnccl_is_found_in_proc_maps(tmp_path):
  maps = tmp_path / "maps"
  maps.write_text(
      "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
      "7f02-7f03 r-xp 00000000 08:01 2 /site/nvidia/nccl/lib/libnccl.so.2\n"
      "7f04-7f05 rw-p 00000000 00:00 0 \n")
  assert device_lib._mapped_nccl(str(maps)) == [  # pylint: disable=protected-access
      "/site/nvidia/nccl/lib/libnccl.so.2"]
  maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
  assert device_lib._mapped_nccl(str(maps)) == []  # pylint: disable=protected-access
  assert device_lib._mapped_nccl(str(tmp_path / "none")) == []  # pylint: disable=protected-access


def test_an_unloadable_or_odd_nccl_reads_as_unknown(monkeypatch, tmp_path):
  fake = tmp_path / "libnccl.so.2"
  fake.write_bytes(b"not a library")
  monkeypatch.setattr(device_lib, "_mapped_nccl", lambda: [str(fake)])
  device_lib.loaded_nccl_version.cache_clear()
  try:
    assert device_lib.loaded_nccl_version() is None

    class NoVersion:  # A library without ncclGetVersion.
      def __getattr__(self, name):
        raise AttributeError(name)
    monkeypatch.setattr(ctypes, "CDLL", lambda path: NoVersion())
    device_lib.loaded_nccl_version.cache_clear()
    assert device_lib.loaded_nccl_version() is None
  finally:
    device_lib.loaded_nccl_version.cache_clear()


def test_no_nccl_loaded_on_the_cpu_backend():
  # This process runs JAX on CPU: XLA loaded no NCCL.
  device_lib.loaded_nccl_version.cache_clear()
  assert device_lib.loaded_nccl_version() is None
  facts = selection.device_facts()
  assert facts.nccl_version is None


class _FakeNccl:
  def __init__(self, code):
    self.code = code

  def ncclGetVersion(self, out):  # pylint: disable=invalid-name
    out._obj.value = self.code  # pylint: disable=protected-access
    return 0


@pytest.mark.parametrize("first,expected", [
    (23206, (2, 32, 6)),   # The preloaded copy binds first: it counts.
    (None, (2, 28, 9)),    # None resolves globally: the lowest.
])
def test_two_mapped_copies_read_as_the_one_bound_first(
    monkeypatch, first, expected):
  copies = {"/image/libnccl.so.2": 22809, "/site/libnccl.so.2": 23206}
  monkeypatch.setattr(device_lib, "_mapped_nccl", lambda: list(copies))

  def cdll(path):
    if path is None:
      return _FakeNccl(first) if first else object()
    return _FakeNccl(copies[path])
  monkeypatch.setattr(ctypes, "CDLL", cdll)
  device_lib.loaded_nccl_version.cache_clear()
  try:
    assert device_lib.loaded_nccl_version() == expected
  finally:
    device_lib.loaded_nccl_version.cache_clear()
