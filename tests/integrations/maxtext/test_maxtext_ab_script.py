"""scripts/maxtext_ab.py against real MaxText on 8 CPU devices: two rounds of
two arms, each round's run under its own name and files, step times pooled,
every round's losses compared."""
import json
import os
import subprocess
import sys

import maxtext_runs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def test_two_rounds_of_off_and_ring(tmp_path):
  out = tmp_path / "ab"
  argv = [sys.executable, os.path.join(REPO, "scripts", "maxtext_ab.py"),
          "--out", str(out), "--arms", "off,ring", "--rounds", "2",
          "--timeout", "600", "--", maxtext_runs.maxtext_base_yml(),
          "hardware=cpu", "skip_jax_distributed_system=True",
          "dataset_type=synthetic", "model_name=llama2-7b",
          "override_model_config=True", "base_num_decoder_layers=2",
          "vocab_size=1024", "max_target_length=128",
          "per_device_batch_size=1", "steps=4", "enable_checkpointing=False",
          f"jax_cache_dir={maxtext_runs.CACHE}",
          *maxtext_runs.MODELS["llama2-7b"], *maxtext_runs.MESHES["ts4_data2"]]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8",
             TF_CPP_MIN_LOG_LEVEL="2",
             PYTHONPATH=os.pathsep.join([os.path.join(REPO, "plugin"),
                                         os.path.join(REPO, "host"),
                                         os.environ.get("PYTHONPATH", "")]))
  run = subprocess.run(argv, capture_output=True, text=True, env=env,
                       timeout=1500, cwd=tmp_path)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  # The order reverses in the second round.
  order = [line.split()[2].rstrip(",") for line in run.stdout.splitlines()
           if line.startswith("== arm ")]
  assert order == ["off", "ring", "ring", "off"]
  result = json.loads((out / "ab.json").read_text())
  assert result["rounds"] == 2 and result["comparison"]["ok"]
  for arm in result["arms"]:
    assert len(arm["rounds"]) == 2
    assert [f"run_name=ab_{arm['arm']}_r{r}" in arm["rounds"][r]["command"]
            for r in range(2)] == [True, True]
    for r in range(2):
      assert (out / f"{arm['arm']}_r{r}.metrics.jsonl").exists()
      assert len(arm["rounds"][r]["losses"]) == 4
    # Steps 2 and 3 of both rounds are pooled.
    assert len(arm["timed_step_times_s"]) == 4
  ring = {r["arm"]: r for r in result["comparison"]["rows"]}["ring"]
  assert len(ring["round_ratios_vs_baseline"]) == 2
  assert ring["max_rel_loss_diff"] < 2e-2
  assert "ring / off, round by round: " in (out / "report.md").read_text()
