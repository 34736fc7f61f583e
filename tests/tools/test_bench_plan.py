"""`--plan`: every call a GPU run would time checked on CPU before device
time is spent (tools/bench_plan.py): GPU runs lost variants to shared
memory that a CPU could have counted, and bench_gemm_core's upstream arm
crashed on the GPU where --plan had traced only our kernels."""
import argparse
import json
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from collective_matmul import kernels
from cm_test_utils import import_script

# 64 x 256 warpgroup tiles with a 64 x 128 epilogue tile: run 53's variant
# that did not fit (263168 bytes).
TOO_BIG = kernels.AllGatherConfig(tile_m=64, tile_n=256, wg_dimension="m",
                                  epi_tile_n=128)
FITS = kernels.AllGatherConfig(tile_m=64, tile_n=256, wg_dimension="m")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _plan():
  return import_script("bench_plan")


def _all_gather_call(plan, config, **kw):
  return plan.ring_call("ag", "all_gather", config, 512, 1024, 512, 2, **kw)


def _reduce_scatter_call(plan, config):
  return plan.ring_call("rs", "reduce_scatter", config, 512, 1024, 512, 2)


def test_a_config_over_shared_memory_fails_and_one_that_fits_passes():
  plan = _plan()
  ok = "lowered" if plan.LOWERS_OFF_GPU else "traced"
  assert plan.check_call(_all_gather_call(plan, FITS)) == ok
  assert plan.check_call(_reduce_scatter_call(
      plan, kernels.ReduceScatterConfig())) == ok
  status = plan.check_call(_all_gather_call(plan, TOO_BIG))
  assert status.startswith("FAILED ValueError") and "263168" in status


def test_the_trace_ranges_count_against_shared_memory():
  """Run 37: configs that fit untraced failed under trace_warpgroups."""
  plan = _plan()
  assert not plan.check_call(_all_gather_call(
      plan, FITS, trace_ranges=8)).startswith("FAILED")
  status = plan.check_call(_all_gather_call(plan, FITS, trace_ranges=5000))
  assert status.startswith("FAILED under trace_warpgroups (5000 ranges): "
                           "ValueError"), status


def test_check_plan_counts_failures_and_prints_each_config():
  plan = _plan()
  lines = []
  calls = [_all_gather_call(plan, FITS), _all_gather_call(plan, TOO_BIG),
           plan.Broken("patched", 2, "TypeError: no field x")]
  assert plan.check_plan(calls, print_fn=lines.append) == 2
  text = "\n".join(lines)
  assert "tile_m=64 tile_n=256 wg_dimension=m epi_tile_n=128" in text
  assert "FAILED TypeError: no field x" in text
  assert text.splitlines()[-1] == "plan: 1 ok, 2 failed"


def test_more_devices_than_emulated_is_a_clear_error():
  with pytest.raises(SystemExit, match="xla_force_host_platform_device_count"):
    _plan().cpu_mesh(len(jax.devices("cpu")) + 1)


def test_bench_kernels_plans_what_it_would_time():
  """The calls `plan_calls` builds are the run's: the picked config and
  each --config per shape, a loopback one's kernel wrapped in
  `diagnostics.loopback` and not traced."""
  bench = import_script("bench_kernels")
  args = argparse.Namespace(
      shapes=["1024/4096/4096:bf16"], rs_shapes=["512/4096/4096:f16"],
      config=[bench.parse_config(kernels.AllGatherConfig, json.dumps(
          {"selected": True, "tile_m": 64, "tile_n": 256,
           "wg_dimension": "m", "loopback": True}))],
      rs_config=[bench.parse_config(kernels.ReduceScatterConfig,
                                    '{"selected": true, "tile_k": 7}')],
      trace_dir="/tmp/traces", skip_seed=False)
  plan = _plan()
  everything = bench.plan_calls(args, 2)
  calls = [c for c in everything if not isinstance(c, plan.FnCall)]
  labels = [c.label for c in calls]
  assert labels == ["all_gather 1024/4096/4096:bf16 ours",
                    "all_gather 1024/4096/4096:bf16 ours_cfg1 (loopback)",
                    "reduce_scatter 512/4096/4096:f16 ours",
                    "reduce_scatter 512/4096/4096:f16 ours_cfg1"]
  ours, loopback, _, broken = calls
  from collective_matmul import selection  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  assert ours.config == selection.select_config(1024, 4096, 4096,
                                                jnp.bfloat16, 2)
  assert ours.trace_ranges == bench.trace_ranges(ours.config, 1024, 4096, 2,
                                                 132)
  assert loopback.config.tile_n == 256 and loopback.trace_ranges is None
  # The kernel in loopback (diagnostics: wrong results), the others plain.
  assert ours.kernel is kernels.all_gather_lhs_matmul and not ours.kwargs
  assert loopback.kernel.__wrapped__ is kernels.all_gather_lhs_matmul
  assert not loopback.kwargs
  assert "tile_k=7" in broken.error
  # The other arms get the operands the run gives them.
  others = {c.label.rsplit(" ", 1)[-1] if "seed" not in c.label else
            c.label.split(" ", 2)[-1]: c for c in everything[:6]}
  assert others["bound"].shapes == [(1024, 4096), (4096, 4096)]
  assert others["nccl"].shapes == ours.shapes == [(2048, 4096), (4096, 8192)]
  assert others["nccl"].in_specs == ours.in_specs
  assert [c.dtype for c in everything if ":f16 " in c.label
          and not isinstance(c, plan.Broken)] == [jnp.float16] * 4


def _run(script, *args):
  folder = "scripts" if script == "autotune.py" else "tools"
  return subprocess.run([sys.executable, os.path.join(REPO_ROOT, folder,
                                                      script), *args],
                        capture_output=True, text=True, timeout=300,
                        cwd=REPO_ROOT)


def _statuses(run):
  """{label: status} of a --plan run's lines, in order."""
  out = {}
  for line in run.stdout.splitlines():
    label, sep, rest = line.strip().rpartition(" D=")
    if sep and line.startswith("  ") and not line.startswith("      "):
      out[label.strip()] = rest.split(" ", 1)[1]
  return out


def test_bench_kernels_plan_fails_on_a_config_that_cannot_run():
  """The 64 x 256 tiles patched into the picked config do not fit at
  512/4096/4096, whose pick has 128-wide k blocks."""
  run = _run("bench_kernels.py", "--plan", "2", "--skip-seed", "--shapes",
             "1024/4096/4096", "512/4096/4096", "--rs-shapes", "--config",
             '{"selected": true, "tile_m": 64, "tile_n": 256, '
             '"wg_dimension": "m"}')
  assert run.returncode == 1, run.stderr[-2000:]
  ours = {label: status for label, status in _statuses(run).items()
          if " ours" in label}
  assert len(ours) == 4, run.stdout
  failed = [label for label, status in ours.items()
            if status.startswith("FAILED")]
  assert failed == ["all_gather 512/4096/4096:bf16 ours_cfg1"], run.stdout
  assert "needs 328704 bytes of shared memory" in ours[failed[0]]
  assert run.stdout.splitlines()[-1].endswith(" ok, 1 failed")


def test_bench_kernels_plans_every_arm():
  """Besides our kernels: the bound's cuBLAS GEMM on one device and on
  all, NCCL + cuBLAS, upstream's collective matmul (both configs of its
  sweep) and the portable ring the run checks."""
  run = _run("bench_kernels.py", "--plan", "2", "--shapes", "512/1024/512",
             "--rs-shapes", "512/1024/512")
  statuses = _statuses(run)
  ag, rs = "all_gather 512/1024/512:bf16", "reduce_scatter 512/1024/512:bf16"
  assert list(statuses) == [
      f"{ag} bound", f"{ag} bound_all", f"{ag} nccl", f"{ag} seed #0",
      f"{ag} seed #1", f"{ag} ours", f"{ag} ring", f"{rs} bound",
      f"{rs} bound_all", f"{rs} nccl", f"{rs} ours"], run.stdout
  assert not [s for s in statuses.values() if s.startswith("FAILED")], (
      run.stdout)
  assert run.returncode == 0, run.stdout + run.stderr[-2000:]
  skipped = _statuses(_run("bench_kernels.py", "--plan", "2", "--skip-seed",
                           "--shapes", "512/1024/512", "--rs-shapes"))
  assert len(skipped) == 5 and not [x for x in skipped if "seed" in x]


def test_bench_kernels_plans_the_fp8_rings_and_xla_s_fp8_program():
  """`m/k/n:fp8`: XLA's fp8 GEMM alone and after its collective, the fp8
  pick's ring through the op (lowered for CUDA at D = 2 from JAX 0.12; the
  reduce-scatter's e5m2 x e4m3 wgmma needs JAX >= 0.11) and the portable
  ring; no upstream arm (it takes no fp8)."""
  run = _run("bench_kernels.py", "--plan", "2", "--shapes", "512/1024/512:fp8",
             "--rs-shapes", "512/1024/512:fp8")
  statuses = _statuses(run)
  assert list(statuses) == [
      f"{pattern} 512/1024/512:fp8 {arm}"
      for pattern in ("all_gather", "reduce_scatter")
      for arm in ("bound", "bound_all", "nccl", "ours", "ring")], run.stdout
  assert not [s for s in statuses.values() if s.startswith("FAILED")], (
      run.stdout)
  assert run.returncode == 0, run.stdout + run.stderr[-2000:]


FP8_ARMS = ("cublas_fp8", "cublas_fp8_rs", "ours_fp8", "ours_fp8_rs")


def test_bench_gemm_core_plans_every_arm():
  """cuBLAS, our two kernels and upstream's Hopper matmul without and with
  2-block clusters: on the GPU the upstream arm crashed (AttributeError in
  upstream_config) because --plan traced only our kernels. Then the fp8
  arms: cuBLASLt's fp8 GEMM (e4m3 and e5m2 lhs) and our two fp8 cores;
  JAX 0.10 cannot trace the reduce-scatter's e5m2 x e4m3 core (its wgmma
  takes one dtype), which the plan reports as skipped, not failed."""
  shape = "2048/1024/1024"
  run = _run("bench_gemm_core.py", "--plan", "--shapes", shape)
  statuses = _statuses(run)
  assert list(statuses) == [
      f"{shape} {arm}" for arm in ("cublas", "ours_ag", "ours_rs",
                                   "upstream_none", "upstream_m",
                                   "upstream_n") + FP8_ARMS], run.stdout
  assert not [s for s in statuses.values() if s.startswith("FAILED")], (
      run.stdout)
  assert run.returncode == 0, run.stdout + run.stderr[-2000:]
  mixed = statuses[f"{shape} ours_fp8_rs"]
  if jax.__version__.startswith("0.10."):
    assert mixed.startswith("skipped (needs JAX >= 0.11"), mixed
    assert run.stdout.splitlines()[-1] == (
        "plan: 9 ok, 0 failed, 1 skipped (an older JAX)")
  else:
    assert run.stdout.splitlines()[-1] == "plan: 10 ok, 0 failed"
  skipped = _statuses(_run("bench_gemm_core.py", "--plan", "--skip-upstream",
                           "--skip-fp8", "--shapes", shape))
  assert list(skipped) == [f"{shape} {arm}" for arm in ("cublas", "ours_ag",
                                                        "ours_rs")]


def test_bench_gemm_core_plans_fp8_variants_on_their_own_cores():
  """rs_fp8_NAME varies the reduce-scatter's fp8 core, fp8_NAME the
  all-gather's; a field that does not apply fails the plan. With
  --fp8-forward also the forward from bf16 operands through Flax's
  quantization, XLA's product and the op's with the pallas plan."""
  shape = "2048/1024/1024"
  run = _run("bench_gemm_core.py", "--plan", "--skip-upstream", "--shapes",
             shape, "--variant", 'rs_fp8_deep={"max_concurrent_steps": 3}',
             "--variant", 'fp8_k64={"tile_k": 64}', "--fp8-forward")
  statuses = _statuses(run)
  assert list(statuses) == [
      f"{shape} {arm}" for arm in ("cublas", "ours_ag", "ours_rs") + FP8_ARMS
      + ("ours_rs_fp8_deep", "ours_fp8_k64", "xla_fp8_fwd",
         "ours_fp8_fwd")], run.stdout
  assert statuses[f"{shape} ours_rs_fp8_deep"].split(" ")[0] in (
      "traced", "lowered", "skipped")
  assert "tile_k=64 with fp8" in statuses[f"{shape} ours_fp8_k64"]
  for arm in ("xla_fp8_fwd", "ours_fp8_fwd"):
    assert statuses[f"{shape} {arm}"].split(" ")[0] in ("traced",
                                                       "lowered"), run.stdout
  assert run.returncode == 1


def test_bench_gemm_core_plans_the_rowwise_arms():
  """--rowwise: XLA's rowwise fp8 GEMM on both lhs dtypes and our two fp8
  cores with row and column scales, after the per-tensor fp8 arms (the
  e5m2 x e4m3 core skipped, not failed, on JAX 0.10); --only picks them;
  --skip-fp8 refuses them."""
  shape = "2048/1024/1024"
  run = _run("bench_gemm_core.py", "--plan", "--skip-upstream", "--rowwise",
             "--shapes", shape)
  statuses = _statuses(run)
  rowwise = ("cublas_fp8_rowwise", "cublas_fp8_rs_rowwise",
             "ours_fp8_rowwise", "ours_fp8_rs_rowwise")
  assert list(statuses) == [
      f"{shape} {arm}" for arm in ("cublas", "ours_ag", "ours_rs") + FP8_ARMS
      + rowwise], run.stdout
  assert not [s for s in statuses.values() if s.startswith("FAILED")], (
      run.stdout)
  assert run.returncode == 0, run.stdout + run.stderr[-2000:]
  only = _run("bench_gemm_core.py", "--plan", "--rowwise", "--shapes", shape,
              "--only", "ours_fp8_rowwise")
  assert list(_statuses(only)) == [f"{shape} ours_fp8_rowwise"], only.stdout
  refused = _run("bench_gemm_core.py", "--plan", "--rowwise", "--skip-fp8")
  assert refused.returncode == 2
  assert "--rowwise times fp8 arms" in refused.stderr


def test_bench_gemm_core_plans_only_the_arms_asked_for():
  shape = "2048/1024/1024"
  run = _run("bench_gemm_core.py", "--plan", "--shapes", shape, "--only",
             "cublas_fp8", "ours_fp8")
  assert list(_statuses(run)) == [f"{shape} cublas_fp8",
                                  f"{shape} ours_fp8"], run.stdout
  assert run.returncode == 0, run.stdout + run.stderr[-2000:]


def test_upstream_sees_a_gpu_host_only_while_checked():
  """The plan's device facts (D GPUs of 132 SMs) reach upstream's kernel
  modules while a call is checked, and leave them afterwards."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # pylint: disable=g-import-not-at-top
  plan = _plan()
  real_get_num_sms = hm.get_num_sms
  with plan.gpu_facts([hm], plan.cpu_mesh(2), 132):
    seen = (hm.jax.device_count(), hm.jax.devices()[0].core_count,
            hm.jax.process_count(), hm.get_num_sms())
  assert seen == (2, 132, 1, 132)
  assert hm.jax is jax and hm.get_num_sms is real_get_num_sms


@pytest.mark.parametrize("args,message", [
    (["--shapes", "1024/4096"], "expected m/k/n[:dtype]"),
    (["--shapes", "1024/4096/4096:f8"], "dtype 'f8'"),
    (["--config", '{"tile_q": 1}'], "tile_q"),
    (["--plan", "0"], "must be >= 1"),
])
def test_bench_kernels_rejects_bad_arguments_before_any_gpu_work(args,
                                                                message):
  run = _run("bench_kernels.py", *args)
  assert run.returncode == 2, run.stdout + run.stderr[-2000:]
  assert message in run.stderr


def test_ring_call_gives_each_kernel_its_operands():
  plan = _plan()
  ag = plan.ring_call("x", "all_gather", FITS, 8, 16, 32, 2)
  rs = plan.ring_call("x", "reduce_scatter", FITS, 8, 16, 32, 2)
  assert ag.shapes == [(16, 16), (16, 64)] and ag.out_spec == P(None, "x")
  assert rs.shapes == [(16, 32), (32, 32)] and rs.out_spec == P("x", None)
  with pytest.raises(ValueError, match="all_gather or reduce_scatter"):
    plan.ring_call("x", "all_to_all", FITS, 8, 16, 32, 2)


@pytest.mark.parametrize("pattern", ["all_gather", "reduce_scatter"])
def test_autotune_plans_every_candidate_of_the_sweep(pattern):
  """Every candidate, and the portable ring the sweep checks them
  against."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from collective_matmul import autotuning  # pylint: disable=g-import-not-at-top
  from collective_matmul import selection  # pylint: disable=g-import-not-at-top
  autotune = import_script("autotune")
  plan = _plan()
  args = argparse.Namespace(shapes=["512/1024/512"], collective=pattern,
                            dtype="f16")
  calls = autotune.plan_calls(args, 4)
  expected = list(autotuning.candidate_configs(
      pattern, selection.Problem(512, 1024, 512, jnp.float16, 4)))
  ours = [c for c in calls if isinstance(c, plan.Call)]
  assert [c.config for c in ours] == expected and len(expected) > 5
  assert {(c.devices, c.dtype) for c in calls} == {(4, jnp.float16)}
  assert ours[0].label == f"{pattern} 512/1024/512 #0"
  ring = [c for c in calls if isinstance(c, plan.FnCall)]
  assert [c.label for c in ring] == [f"{pattern} 512/1024/512 ring"]
  assert plan.check_call(ring[0]) in ("traced", "lowered")


@pytest.mark.parametrize("pattern", ["all_gather", "reduce_scatter"])
def test_autotune_plans_an_fp8_sweep(pattern):
  """--dtype fp8: the fp8 problem's candidates (k steps of 128), each a
  kernel call on fp8 operands with the weight K-major and a scale, and
  the portable ring on the same operands."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from collective_matmul import autotuning  # pylint: disable=g-import-not-at-top
  autotune = import_script("autotune")
  plan = _plan()
  args = argparse.Namespace(shapes=["512/1024/512"], collective=pattern,
                            dtype="fp8")
  calls = autotune.plan_calls(args, 2)
  problem = autotune.problem_for(args, 512, 1024, 512, 2)
  assert problem.is_fp8 and problem.out_dtype == jnp.bfloat16
  ours = [c for c in calls if isinstance(c, plan.Call)]
  assert [c.config for c in ours] == list(autotuning.candidate_configs(
      pattern, problem, device=plan.planned_device(devices=2)))
  assert {c.config.tile_k for c in ours} == {128}
  lhs = jnp.float8_e4m3fn if pattern == "all_gather" else jnp.float8_e5m2
  assert {c.dtype for c in calls} == {(lhs, jnp.float8_e4m3fn, jnp.float32)}
  assert ours[0].operand_names == ("scale",)
  ring = calls[-1]
  assert ring.label == f"{pattern} 512/1024/512 ring"
  assert plan.check_call(ring) in ("traced", "lowered")
  assert plan.check_call(ours[0]).split(" ")[0] in ("traced", "lowered",
                                                    "skipped")


def test_autotune_rejects_a_malformed_shape():
  run = _run("autotune.py", "--plan", "2", "--shapes", "512/1024")
  assert run.returncode == 2 and "expected m/k/n" in run.stderr


def test_bench_kernels_plans_the_config_the_gpu_run_picks():
  """The plan picks configs as the H200 run will, packaged table entries
  included (the CPU's own facts key the table by "cpu" and miss them)."""
  from collective_matmul import selection  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  bench = import_script("bench_kernels")
  key = "reduce_scatter|NVIDIA H200|bfloat16|D=2|8192x2048x4096"
  packaged = selection.packaged_table()[key]
  assert packaged != selection.select_reduce_scatter_config(
      8192, 2048, 4096, jnp.bfloat16, 2)  # What the CPU's facts pick.
  args = argparse.Namespace(shapes=[], rs_shapes=["8192/2048/4096:bf16"],
                            config=[], rs_config=[], trace_dir=None,
                            skip_seed=True)
  calls = [c for c in bench.plan_calls(args, 2)
           if not isinstance(c, _plan().FnCall)]
  assert [c.config for c in calls] == [packaged]


def _next_call_arguments():
  """(script, arguments) of the command in benchmarks/rings_h200x2/README.md's
  "Next call" section (the one fenced block there), as a shell passes
  them, less `--out`."""
  import re  # pylint: disable=g-import-not-at-top
  import shlex  # pylint: disable=g-import-not-at-top
  with open(os.path.join(REPO_ROOT, "benchmarks", "rings_h200x2",
                         "README.md")) as f:
    text = f.read()
  section = re.search(r"^## Next call.*?(?=^## )", text, re.M | re.S)
  assert section, "benchmarks/rings_h200x2/README.md has no 'Next call'"
  [block] = re.findall(r"```\n(.*?)```", section.group(0), re.S)
  words = shlex.split(re.sub(r"\\\n\s*", " ", block))
  [script] = [w for w in words if w.startswith("tools/")]
  start = words.index(script) + 1
  out = words.index("--out")
  return os.path.basename(script), words[start:out] + words[out + 2:]


def test_the_next_gpu_calls_command_plans_every_arm():
  """The documented command for the next device call (the fp8 rings at
  D = 2) parses and every arm it times traces (JAX 0.10) or lowers (0.12)
  on CPU: a field renamed since would fail here, not on the GPUs."""
  script, args = _next_call_arguments()
  assert script == "bench_kernels.py"
  run = _run(script, "--plan", "2", *args)
  statuses = _statuses(run)
  for flag in ("--shapes", "--rs-shapes"):
    for shape in args[args.index(flag) + 1:]:
      if shape.startswith("--"):
        break
      assert any(shape in label for label in statuses), (shape, run.stdout)
  assert not [s for s in statuses.values() if s.startswith("FAILED")], (
      run.stdout)
  assert run.returncode == 0, run.stdout + run.stderr[-2000:]
