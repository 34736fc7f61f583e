"""README's MaxText commands against real MaxText (issue 30, items 1, 2
and 6): the CPU recipe run as written (plugin on, and the A/B of off and
auto, with its loss verdict, ab.png and the CPU caveat), the plugin-off
command checked to be the plugin-on one without the flag, and every
MaxText key README passes a key of MaxText's base.yml."""
import os
import re
import subprocess
import sys

import yaml

import maxtext_runs
import readme_commands as rc

CPU_SECTION = "MaxText on CPU"


def _maxtext_commands():
  for block in rc.blocks("bash"):
    names = rc.variables(block)
    for command in rc.commands(block):
      words = rc.argv(command, names)
      if words[:3] == ["python", "-m",
                       "collective_matmul.integrations.maxtext"]:
        yield command, words[3:]
      elif words[:2] == ["python", "scripts/maxtext_ab.py"]:
        yield command, words[words.index("--") + 1:]


def test_every_maxtext_key_in_readme_is_one_of_maxtexts():
  with open(maxtext_runs.maxtext_base_yml()) as f:
    keys = set(yaml.safe_load(f))
  models = os.path.join(os.path.dirname(maxtext_runs.maxtext_base_yml()),
                        "models")
  checked = 0
  for command, words in _maxtext_commands():
    assert words[0] == rc.BASE_PLACEHOLDER, command
    for word in words[1:]:
      if word.startswith("-"):
        continue
      key, _, value = word.partition("=")
      assert key in keys, (key, command)
      if key == "model_name":
        assert os.path.exists(os.path.join(models, f"{value}.yml")), value
      checked += 1
  assert checked > 20


def test_the_plugin_off_command_is_the_plugin_on_command_without_the_flag():
  (block,) = rc.blocks("bash", CPU_SECTION)
  launches = [c for c in rc.commands(block)
              if "-m collective_matmul.integrations.maxtext" in c]
  assert len(launches) == 2
  on, off = launches
  assert on.endswith(" --use_collective_matmul")
  strip = lambda c: re.sub(r"run_name=\S+", "", c)
  assert strip(on.removesuffix(" --use_collective_matmul")) == strip(off)


def test_the_cpu_recipe_runs_as_written_and_says_what_happened(tmp_path):
  (block,) = rc.blocks("bash", CPU_SECTION)
  # Installed already (this environment is the one it builds); the
  # plugin-off run is the plugin-on one without the flag (test above), and
  # the A/B runs it again as its 'off' arm.
  kept = [c for c in rc.commands(block)
          if not c.startswith("pip install")
          and not ("-m collective_matmul.integrations.maxtext" in c
                   and "--use_collective_matmul" not in c)]
  script = "set -euo pipefail\n" + "\n".join(kept) + "\n"
  # Run where a user's checkout is: scripts/ beside the outputs.
  os.symlink(os.path.join(rc.REPO_ROOT, "scripts"), tmp_path / "scripts")
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
  # The session's compile cache (MaxText reads M_<KEY> for any key).
  env["M_JAX_CACHE_DIR"] = maxtext_runs.CACHE
  run = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=1500)
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
  out = run.stdout
  # The launcher's closing summary.
  summary = out[out.index("collective matmul summary (MaxText "):]
  assert "rewritten: 8 of 8 projections" in summary, summary
  assert "left to MaxText / XLA: 0 (none)" in summary
  for name in ("attention/query", "mlp/wo", "decoder/logits_dense"):
    assert name in summary.split("plugin on")[0], name
  # The A/B's verdict and files.
  assert re.search(r"^auto vs off: losses match \(max relative difference "
                   r"\S+, tolerance \S+\); auto is [\d.]+ % (faster|slower) "
                   r"than off \(median step time\)$", out, re.M), out[-3000:]
  assert "do not measure the GPU overlap" in out
  ab = tmp_path / "ab_cpu"
  assert (ab / "ab.png").stat().st_size > 0
  report = (ab / "report.md").read_text()
  assert "auto vs off: losses match" in report
  assert "do not measure the GPU overlap" in report
