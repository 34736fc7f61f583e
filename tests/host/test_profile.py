"""The step-time breakdown reads real GPU traces and does its interval
arithmetic right."""
import dataclasses
import gzip
import json
import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import pytest

from reference_host import ab as ab_lib
from reference_host import profile as profile_lib

DATA = os.path.join(os.path.dirname(__file__), "data")
TRACE = os.path.join(DATA, "trace_llama2_2layers_ts2_{}.json.gz")
STEPS = 3  # profiled steps in each recorded trace


def _breakdown(arm):
  return profile_lib.breakdown(profile_lib.load_events(TRACE.format(arm)),
                               steps=STEPS)


def _event(name, start, duration, device="/device:GPU:0", scope=""):
  return profile_lib.KernelEvent(name=name, start_us=start,
                                 duration_us=duration, device=device,
                                 stream="Stream #1(Compute)", scope=scope)


def test_loads_only_gpu_stream_events_of_both_devices():
  events = profile_lib.load_events(TRACE.format("collective"))
  assert {e.device for e in events} == {"/device:GPU:0", "/device:GPU:1"}
  assert all(e.stream.startswith("Stream #") for e in events)
  assert all(e.duration_us >= 0 for e in events)


@pytest.mark.parametrize("name, hlo_op, expected", [
    ("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_TNT", "custom-call.4", "matmul"),
    ("gemm_fusion_dot_169", "gemm_fusion_dot.169", "matmul"),
    ("anonymous_mosaic_gpu_kernel", "mpmd_map.272", "collective_matmul"),
    ("stream_executor::gpu::MultiGpuBarrierWithNcclKernelImpl(long, long, "
     "ncclWindow_vidmem*, unsigned int*)", "mpmd_map.272", "barrier"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     "all-gather.1.1", "nccl"),
    ("loop_select_fusion_1", "loop_select_fusion.1", "compute"),
    ("input_reduce_fusion_13", "input_reduce_fusion.13", "compute"),
    ("memcpy32_post", "", "memcpy"),
])
def test_classifies_the_kernels_seen_on_h200(name, hlo_op, expected):
  event = dataclasses.replace(_event(name, 0, 1), hlo_op=hlo_op)
  assert profile_lib.classify(event) == expected


def test_exposed_nccl_is_the_part_no_compute_kernel_overlaps():
  # NCCL [0, 10) and [20, 30); compute [5, 12) and [22, 25) on another
  # stream; a barrier [10, 20) does not hide anything.
  events = [_event("ncclDevKernel_AllGather", 0, 10),
            _event("ncclDevKernel_ReduceScatter", 20, 10),
            _event("nvjet_sm90_gemm", 5, 7),
            _event("loop_fusion", 22, 3),
            _event("MultiGpuBarrierWithNcclKernelImpl", 10, 10)]
  b = profile_lib.breakdown(events, steps=1)
  assert b.nccl_exposed_ms == pytest.approx((5 + 7) * 1e-3)
  assert b.class_ms["nccl"] == pytest.approx(20e-3)
  assert b.class_ms["barrier"] == pytest.approx(10e-3)
  assert b.busy_ms == pytest.approx(30e-3)


def test_per_step_figures_divide_by_the_profiled_steps():
  events = [_event("nvjet_gemm", 0, 4000), _event("nvjet_gemm", 10000, 2000)]
  assert profile_lib.breakdown(events, steps=2).class_ms["matmul"] == (
      pytest.approx(3.0))


def test_other_devices_events_are_not_counted():
  events = [_event("nvjet_gemm", 0, 1000),
            _event("nvjet_gemm", 0, 5000, device="/device:GPU:1")]
  assert profile_lib.breakdown(events, 1).class_ms["matmul"] == (
      pytest.approx(1.0))
  assert profile_lib.breakdown(events, 1, device="/device:GPU:1").class_ms[
      "matmul"] == pytest.approx(5.0)


def test_recorded_baseline_exposes_nccl_and_runs_no_collective_kernel():
  b = _breakdown("baseline")
  assert b.class_ms["collective_matmul"] == 0 and b.class_ms["barrier"] == 0
  assert 0 < b.nccl_exposed_ms <= b.class_ms["nccl"]
  # The GEMMs are most of a step of this model (2 layers, seq 4096).
  assert b.class_ms["matmul"] > 0.4 * b.busy_ms
  assert b.busy_ms <= sum(b.class_ms.values()) + 1e-9


def test_recorded_collective_arm_hides_most_exposed_nccl():
  base, coll = _breakdown("baseline"), _breakdown("collective")
  assert coll.class_ms["collective_matmul"] > 10  # 30 kernels per step
  assert coll.nccl_exposed_ms < 0.5 * base.nccl_exposed_ms
  comparison = profile_lib.compare(base, coll)
  assert comparison.hidden_ms == pytest.approx(
      base.nccl_exposed_ms - coll.nccl_exposed_ms)
  assert comparison.replaced_gemm_ms == pytest.approx(
      base.class_ms["matmul"] - coll.class_ms["matmul"])
  sentence = comparison.sentence()
  assert f"baseline exposes {base.nccl_exposed_ms:.2f} ms" in sentence
  assert f"hides {comparison.hidden_ms:.2f} ms" in sentence


def test_projection_attribution_splits_forward_and_backward():
  coll = _breakdown("collective")
  for name in ("query", "key", "value", "out", "wi_0", "wi_1", "wo",
               "logits_dense"):
    for direction in ("forward", "backward"):
      assert coll.projections[f"{name} {direction}"][
          "collective_matmul"] > 0, (name, direction)
  assert profile_lib.projection_of(
      "jit(f)/transpose(jvp(Transformer))/layers_1/mlp/wi_0/shard_map/x") == (
          "wi_0 backward")
  assert profile_lib.projection_of(
      "jit(f)/jvp(Transformer)/layers_0/self_attention/query/dot_general") == (
          "query forward")
  assert profile_lib.projection_of("jit(f)/jvp(Transformer)/rope/mul") == ""
  assert profile_lib.projection_of(
      "jit(f)/transpose(jvp(T))/layers_0/mlp/wi_0+wi_1/shard_map/x") == (
          "wi_0+wi_1 backward")
  assert profile_lib.projection_of("jit(f)/jvp(T)/a+b/dot") == ""


def test_device_trace_copy_gives_the_same_breakdown(tmp_path):
  copy = str(tmp_path / "copy.json.gz")
  profile_lib.write_device_trace(TRACE.format("collective"), copy)
  again = profile_lib.breakdown(profile_lib.load_events(copy), STEPS)
  assert again == _breakdown("collective")


def test_no_gpu_events_is_an_error(tmp_path):
  path = tmp_path / "cpu.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1,
         "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 5, "name": "x"}]}, f)
  with pytest.raises(ValueError, match="no GPU stream events"):
    profile_lib.breakdown(profile_lib.load_events(str(path)), 1)


def test_lists_the_collectives_a_compiled_program_runs():
  mesh = jax.make_mesh((4,), ("x",))
  gathered = jax.jit(
      lambda a, b: a @ b,
      in_shardings=(NamedSharding(mesh, PartitionSpec("x", None)),
                    NamedSharding(mesh, PartitionSpec(None, "x"))),
      out_shardings=NamedSharding(mesh, PartitionSpec()))
  text = gathered.lower(jnp.ones((64, 32), jnp.float32),
                        jnp.ones((32, 64), jnp.float32)).compile().as_text()
  found = profile_lib.collectives_in_hlo(text)
  assert found and all(c["op"].startswith("all-gather") for c in found)
  assert max(c["bytes"] for c in found) == 64 * 64 * 4
  local = jax.jit(lambda a: a * 2).lower(jnp.ones(4)).compile().as_text()
  assert profile_lib.collectives_in_hlo(local) == []


def test_report_has_the_breakdown_table_and_the_sentence(tmp_path):
  base, coll = _breakdown("baseline"), _breakdown("collective")
  profile = {"baseline": base, "collective": coll,
             "comparison": profile_lib.compare(base, coll),
             "collectives": {"baseline": [], "collective": [
                 {"name": "all-gather.1", "op": "all-gather",
                  "shape": "bf16[4,4096,4096]", "bytes": 2**27,
                  "scope": "x"}]},
             "traces": {"baseline": "b.json.gz", "collective": "c.json.gz"}}
  lines = ab_lib._profile_markdown(profile)  # pylint: disable=protected-access
  text = "\n".join(lines)
  assert "| NCCL not overlapped by compute |" in text
  assert profile["comparison"].sentence() in text
  assert "| wi_0 forward |" in text
  assert "`all-gather.1` all-gather bf16[4,4096,4096] (128.0 MiB)" in text
  as_json = ab_lib._profile_json(profile)  # pylint: disable=protected-access
  json.dumps(as_json)
  assert as_json["comparison"]["hidden_ms"] == pytest.approx(
      profile["comparison"].hidden_ms)


@pytest.mark.parametrize("steps,message", [
    (1, "--profile_steps breaks down GPU kernel time"),  # CPU only here
    (-1, "--profile_steps=-1 must be >= 0"),
])
def test_ab_compare_refuses_a_profile_it_cannot_take(steps, message):
  import subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  repo = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  proc = subprocess.run(
      [sys.executable, os.path.join(repo, "scripts", "ab_compare.py"),
       os.path.join(repo, "model_configs", "base.yml"), "model_name=tiny",
       f"--profile_steps={steps}"], capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert message in proc.stderr


_XSPACE = """
planes {
  id: 1
  name: "/device:GPU:0"
  lines { id: 1 name: "Stream #24(Compute)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000
             stats { metadata_id: 2 str_value: "custom-call.1" }
             stats { metadata_id: 3 ref_value: 4 } }
    events { metadata_id: 5 offset_ps: 2000000 duration_ps: 6000000 }
  }
  lines { id: 2 name: "XLA Ops" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 }
  }
  event_metadata { key: 1 value { id: 1 name: "nvjet_sm90_gemm" } }
  event_metadata { key: 5 value { id: 5 name: "ncclDevKernel_AllGather" } }
  stat_metadata { key: 2 value { id: 2 name: "hlo_op" } }
  stat_metadata { key: 3 value { id: 3 name: "name" } }
  stat_metadata { key: 4 value { id: 4
                  name: "jit(f)/jvp(M)/layers_0/mlp/wi_0/dot_general" } }
}
planes { id: 2 name: "/host:CPU"
  lines { id: 1 name: "python" events { metadata_id: 1 duration_ps: 9 } }
  event_metadata { key: 1 value { id: 1 name: "host work" } }
}
"""


def test_reads_xspace_profiles_as_maxtext_writes_them():
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  events = profile_lib.load_xspace_events(ProfileData.from_text_proto(_XSPACE))
  assert [(e.name, e.start_us, e.duration_us, e.hlo_op) for e in events] == [
      ("nvjet_sm90_gemm", 1.0, 5.0, "custom-call.1"),
      ("ncclDevKernel_AllGather", 3.0, 6.0, "")]
  b = profile_lib.breakdown(events, steps=1)
  assert b.nccl_exposed_ms == pytest.approx(3e-3)  # [6, 9) us uncovered
  assert b.projections == {"wi_0 forward": {"matmul": pytest.approx(5e-3)}}


def _maxtext_ab():
  import importlib.util  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  spec = importlib.util.spec_from_file_location(
      "maxtext_ab", os.path.join(repo, "scripts", "maxtext_ab.py"))
  maxtext_ab = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(maxtext_ab)
  return maxtext_ab


def test_maxtext_ab_compares_each_arm_with_off():
  maxtext_ab = _maxtext_ab()
  arms = [{"arm": "off", "profile": _breakdown("baseline").to_json()},
          {"arm": "auto", "profile": _breakdown("collective").to_json()},
          {"arm": "windowed", "profile": {"error": "no trace"}}]
  comparisons = maxtext_ab.profile_comparisons(arms)
  assert list(comparisons) == ["auto"]
  expected = profile_lib.compare(_breakdown("baseline"),
                                 _breakdown("collective"))
  assert comparisons["auto"]["sentence"] == expected.sentence()
  assert comparisons["auto"]["baseline"] == "off"


def test_maxtext_ab_compares_an_arm_with_the_baseline_it_is_given():
  maxtext_ab = _maxtext_ab()
  arms = [{"arm": "off", "profile": _breakdown("collective").to_json(),
           "losses": [2.0, 1.0], "median_step_ms": 100.0, "rc": 0},
          {"arm": "attn", "profile": _breakdown("baseline").to_json(),
           "losses": [2.0, 1.0], "median_step_ms": 80.0, "rc": 0},
          {"arm": "auto_attn", "profile": _breakdown("collective").to_json(),
           "losses": [2.0, 1.0], "median_step_ms": 76.0, "rc": 0}]
  baselines = {"auto_attn": "attn"}
  comparisons = maxtext_ab.profile_comparisons(arms, baselines)
  assert comparisons["auto_attn"]["baseline"] == "attn"
  assert comparisons["auto_attn"]["sentence"] == profile_lib.compare(
      _breakdown("baseline"), _breakdown("collective")).sentence()
  assert comparisons["attn"]["baseline"] == "off"
  # An arm without our kernels is not described as rewriting anything.
  assert "runs no collective matmul kernel" in comparisons["attn"]["sentence"]
  assert "rewritten" not in comparisons["attn"]["sentence"]
  assert "rewritten GEMMs" in comparisons["auto_attn"]["sentence"]
  rows = {r["arm"]: r for r in
          maxtext_ab.compare(arms, "bfloat16", baselines)["rows"]}
  assert rows["auto_attn"]["ratio_vs_off"] == pytest.approx(0.76)
  assert rows["auto_attn"]["ratio_vs_baseline"] == pytest.approx(0.95)
  assert rows["attn"]["ratio_vs_baseline"] == pytest.approx(0.8)


def test_baseline_rows_of_grouped_members_are_summed_into_the_group():
  baseline = {"query forward": {"matmul": 1.0}, "key forward": {"matmul": 0.5,
                                                                 "nccl": 0.25},
              "value forward": {"matmul": 0.5}, "wo forward": {"matmul": 2.0}}
  collective = {"query+key+value forward": {"collective_matmul": 2.5},
                "wo forward": {"collective_matmul": 2.2}}
  merged = ab_lib._grouped_like(baseline, collective)  # pylint: disable=protected-access
  assert merged == {"query+key+value forward": {"matmul": 2.0, "nccl": 0.25},
                    "wo forward": {"matmul": 2.0}}


def test_baseline_xla_options_parse_to_typed_values():
  assert ab_lib.parse_xla_options([
      "xla_gpu_threshold_for_windowed_einsum_mib=0",
      "xla_gpu_multi_streamed_windowed_einsum=true", "xla_x=0.5",
      "xla_y=abc"]) == {"xla_gpu_threshold_for_windowed_einsum_mib": 0,
                        "xla_gpu_multi_streamed_windowed_einsum": True,
                        "xla_x": 0.5, "xla_y": "abc"}
  for bad in ("xla_gpu_threshold", "threshold=0"):
    with pytest.raises(ValueError, match="NAME=VALUE"):
      ab_lib.parse_xla_options([bad])
