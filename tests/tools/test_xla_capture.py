"""tools/xla_capture.py reads which kernels XLA recorded into command
buffers from a dump's thunk sequences (the proof of capture the GPU checks
print)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                "tools"))
import xla_capture  # pylint: disable=g-import-not-at-top,wrong-import-position

THUNKS = """\
000: kCommandBuffer
  000: kKernel %fusion.1
  001: kCustomCall %custom-call.4
  002: kCublasLtMatmul %custom-call.1
001: kCustomCall %custom-call.5
002: kWhile
  condition:
  000: kKernel %fusion.2
003: kCommandBuffer
  000: kCustomCall %custom-call.6
"""
HLO = ('%custom-call.4 = bf16[8] custom-call(), custom_call_target="mosaic_gpu_v2"\n'
       '%custom-call.1 = f32[8] custom-call(), custom_call_target="__cublas$lt$matmul"\n')


def test_custom_calls_are_counted_inside_and_outside_command_buffers():
  assert xla_capture.thunk_capture(THUNKS) == (2, 1)
  assert xla_capture.thunk_capture(THUNKS, "kKernel") == (1, 1)
  assert xla_capture.thunk_capture("") == (0, 0)


def test_a_dump_is_summarised_per_module_that_runs_a_kernel(tmp_path):
  (tmp_path / "module_1.jit_step.sm_9.0a_gpu_after_optimizations.txt"
   ).write_text(HLO)
  (tmp_path / "module_1.jit_step.thunk_sequence_after_thunk_passes.txt"
   ).write_text(THUNKS)
  # No thunk passes' dump: no command buffer formed, every kernel outside.
  (tmp_path / "module_2.jit_other.sm_9.0a_gpu_after_optimizations.txt"
   ).write_text(HLO * 2)
  # No Mosaic kernel: not listed.
  (tmp_path / "module_3.jit_plain.sm_9.0a_gpu_after_optimizations.txt"
   ).write_text("ENTRY %main {}\n")
  summary = xla_capture.dump_summary(str(tmp_path))
  assert summary == {"module_1.jit_step.sm_9.0a_gpu": [2, 1],
                     "module_2.jit_other.sm_9.0a_gpu": [0, 2]}
  assert list(xla_capture.dump_summary(str(tmp_path), "other")) == [
      "module_2.jit_other.sm_9.0a_gpu"]
  assert xla_capture.dump_summary(str(tmp_path / "missing")) == {}
