"""The launcher under `hardware=gpu_multiprocess` (one process per GPU, the
layout Transformer Engine's collective GEMM needs): every process decides
the same, from the job's lowest NCCL version.

Two processes of the real launcher on CPU, 2 devices each, a ring over all
4 (`ici_tensor_sequence_parallelism=4`), one step, `--use_collective_matmul`
(impl=auto). MaxText calls `jax.distributed.initialize()` without arguments;
JAX's SLURM detector finds the job from SLURM's variables (set here: job,
node list localhost, 2 tasks, this task's rank) and the coordinator port
from JAX_COORDINATOR_PORT. `launch_gpu_multiprocess.py` stands in each
process's loaded NCCL (CM_FAKE_NCCL) and says the backend is a GPU with
H100s, so `auto` reaches the rule on rings across processes (on CPU it
stops at "backend is 'cpu'" and never asks NCCL); see it for what else is
real. Every projection is then too small for the kernel, so the baseline
runs whatever NCCL says: the records, not a hang, show a disagreement (with
`job_nccl_version` returning each process's own version, process 0 records
"too small" and process 1 the NCCL reason). About 40 s of CPU a job (two
processes); the second job finds the first one's train step in the compile
cache.
"""
import json
import os
import socket
import subprocess
import sys

import pytest

from maxtext_runs import CACHE, DTYPES, MODELS, WORK, maxtext_base_yml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
LAUNCH = os.path.join(HERE, "launch_gpu_multiprocess.py")
TIMEOUT_S = 600
PROJECTIONS = ("attention/query", "attention/key", "attention/value",
               "attention/out", "mlp/wi_0", "mlp/wi_1", "mlp/wo",
               "decoder/logits_dense")
# Anything that could make JAX find another cluster (Open MPI's detector
# comes before SLURM's) or another coordinator.
_CLUSTER_ENV_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "JAX_COORDINATOR",
                         "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                         "JAX_LOCAL_DEVICE_IDS")


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _parse(version):
  return None if version == "none" else [int(x) for x in version.split(".")]


def _summary(log):
  """The launcher's end-of-run summary in `log` (its lines; other output,
  e.g. a log line on stderr, skipped)."""
  lines = log.splitlines()
  start = next(i for i, line in enumerate(lines)
               if line.startswith("collective matmul summary ("))
  summary = []
  for line in lines[start + 1:]:
    if line.startswith("  "):
      summary.append(line)
      if line.startswith("  plugin "):
        break
  return summary


def _job(name, nccl):
  """Runs the 2-process job, process i with fake NCCL nccl[i]; returns
  (what each process wrote, each one's stderr)."""
  port = str(_free_port())
  out_dir = os.path.join(WORK, name)
  os.makedirs(out_dir, exist_ok=True)
  argv = [sys.executable, LAUNCH, maxtext_base_yml(), f"run_name={name}",
          f"base_output_directory={WORK}", "hardware=gpu_multiprocess",
          "dataset_type=synthetic", "model_name=llama2-7b",
          "override_model_config=True", "base_num_decoder_layers=2",
          "vocab_size=1024", "max_target_length=128",
          "per_device_batch_size=1", "steps=1", "enable_checkpointing=False",
          "async_checkpointing=False", f"jax_cache_dir={CACHE}",
          "log_config=False", "ici_tensor_sequence_parallelism=4",
          "ici_data_parallelism=1", "ici_fsdp_parallelism=1",
          *MODELS["llama2-7b"], *DTYPES["bf16"], "--use_collective_matmul"]
  base_env = {k: v for k, v in os.environ.items()
              if not k.startswith(_CLUSTER_ENV_PREFIXES)}
  # This checkout's plugin, whatever is installed (the processes run in
  # their own directory, where a relative PYTHONPATH finds nothing).
  base_env["PYTHONPATH"] = os.pathsep.join(
      [os.path.join(REPO, "plugin"), os.path.join(REPO, "host"),
       *filter(None, [os.environ.get("PYTHONPATH")])])
  procs, files = [], []
  try:
    for pid in range(2):
      env = dict(base_env, JAX_PLATFORMS="cpu",
                 # JAX 0.12's default, said here: the CPU collectives
                 # across processes.
                 JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                 XLA_FLAGS="--xla_force_host_platform_device_count=2",
                 TF_CPP_MIN_LOG_LEVEL="2", SLURM_JOB_ID="4242",
                 SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                 SLURM_PROCID=str(pid), SLURM_LOCALID=str(pid),
                 JAX_COORDINATOR_PORT=port, CM_FAKE_NCCL=nccl[pid],
                 CM_DECISIONS_OUT=os.path.join(out_dir, f"{pid}.json"))
      log = os.path.join(out_dir, f"{pid}.log")
      files.append((env["CM_DECISIONS_OUT"], log))
      with open(log, "w") as f:
        procs.append(subprocess.Popen(argv, stdout=f,
                                      stderr=subprocess.STDOUT, env=env,
                                      cwd=out_dir))
    for proc in procs:
      try:
        proc.wait(timeout=TIMEOUT_S)
      except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: a process hung (processes that disagree?)")
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  logs = []
  for pid, (proc, (_, log)) in enumerate(zip(procs, files)):
    with open(log) as f:
      logs.append(f.read())
    assert proc.returncode == 0, (
        f"{name}: process {pid} failed ({proc.returncode}):\n"
        f"{' '.join(argv)}\n{logs[-1][-6000:]}")
  results = []
  for path, _ in files:
    with open(path) as f:
      results.append(json.load(f))
  return results, logs


@pytest.mark.parametrize("nccl,names_nccl", [
    (("2.32.6", "2.28.9"), True),
    (("2.32.6", "2.32.6"), False),
])
def test_gpu_multiprocess_processes_decide_the_same_from_the_jobs_nccl(
    nccl, names_nccl):
  results, logs = _job(f"gpu-mp-{'-'.join(nccl)}", nccl)
  for pid, (result, log) in enumerate(zip(results, logs)):
    assert result["plugin_file"].startswith(os.path.join(REPO, "plugin"))
    # MaxText's own gpu_multiprocess initialization made the job: two
    # processes of 2 devices each, found from the environment.
    assert ("initialize the jax distributed system for gpu_multiprocess "
            "hardware") in log
    assert "completed step: 0" in log
    assert (result["process_index"], result["process_count"],
            result["local_device_count"]) == (pid, 2, 2)
    assert result["own_nccl"] == _parse(nccl[pid])
  first, second = results
  # What a ring needs: every process took the same path for every
  # projection (and said why in the same words).
  assert first["decisions"] == second["decisions"]
  decisions = first["decisions"]
  # And what each printed at the end says so.
  summary = _summary(logs[0])
  assert summary == _summary(logs[1])
  assert summary[0] == "  rewritten: 8 of 8 projections"
  assert ("NCCL 2.28.9" in "\n".join(summary)) == names_nccl
  assert [d.split(" ")[0] for d in decisions] == list(PROJECTIONS)
  # Both decided from the job's lowest NCCL, not their own.
  job = min(_parse(v) for v in nccl)
  for result in results:
    assert result["job_nccl"] == job
    assert [(f["platform"], f["process_count"], f["local_device_count"],
             f["nccl_version"]) for f in result["facts"]] == [
                 ("gpu", 2, 2, job)]
  for decision in decisions:
    assert ": rewritten -> baseline over 'tensor_sequence'" in decision
    if names_nccl:
      assert ("the ring over 4 devices spans several processes (2 processes "
              "of 2 devices), which needs NCCL >= 2.29.2 on every process "
              "(NCCL 2.28.9)") in decision
    else:
      # The rule on processes passed; the next one (too small for the
      # kernel) decided.
      assert "NCCL" not in decision and "spans several processes" not in (
          decision)
      assert "output tiles per ring step" in decision
