"""README.md's commands work as written (issue 30, items 1 and 6): the
Quickstart is run as a user runs it, and every other command is parsed
against the real parsers (pip extras, the launcher's and the plugin's absl
flags, scripts/maxtext_ab.py's options); the Python example names only what
the package exports. tests/integrations/maxtext/test_readme_maxtext.py runs
the MaxText CPU recipe."""
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys

from absl import flags
import pytest

import collective_matmul as cm
import readme_commands as rc


def _maxtext_ab_parser():
  spec = importlib.util.spec_from_file_location(
      "maxtext_ab", os.path.join(rc.REPO_ROOT, "scripts", "maxtext_ab.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.build_parser()


def _launcher_flag_names():
  # The launcher's flags: the plugin's, the attention option's and its own
  # (importing them needs no MaxText).
  from collective_matmul.integrations.maxtext import attention  # pylint: disable=g-import-not-at-top
  from collective_matmul.integrations.maxtext import summary  # pylint: disable=g-import-not-at-top
  names = set()
  for module in (cm.flags, attention, summary):
    names |= {f.name for f in flags.FLAGS.get_flags_for_module(module)}
  return names


def _all_commands():
  out = []
  for block in rc.blocks("bash"):
    names = rc.variables(block)
    for command in rc.commands(block):
      for part in command.split("&&"):
        out.append((part.strip(), rc.argv(part.strip(), names)))
  return out


def test_the_quickstart_trains_both_arms_and_says_the_losses_match(tmp_path):
  (block,) = rc.blocks("bash", "Quickstart (Python 3.11, no GPU)")
  install, tests = rc.commands(block)
  pip, train = (part.strip() for part in install.split("&&"))
  assert set(rc.pip_extras(rc.argv(pip, {}))) <= rc.setup_extras()
  assert rc.argv(tests, {}) == ["python", "-m", "pytest", "-q", "tests"]
  words = rc.argv(train, {})
  assert words[:2] == ["python", "scripts/train.py"]
  # A demo run before: the next one replaces its output.
  stale = tmp_path / "runs" / "demo"
  stale.mkdir(parents=True)
  (stale / ".reference_host_demo").write_text("")
  (stale / "metrics.jsonl").write_text('{"step": 99}\n')
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  run = subprocess.run(
      [sys.executable, os.path.join(rc.REPO_ROOT, *words[1].split("/")),
       *words[2:]], cwd=tmp_path, env=env, capture_output=True, text=True,
      timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "layers_0/mlp/wi_0" in run.stdout and "rewritten -> " in run.stdout
  assert re.search(r"^--- loss matches the baseline: max relative "
                   r"difference \S+ over 12 steps", run.stdout, re.M)
  # README: checkpoints and metrics.jsonl in runs/demo.
  records = [json.loads(line) for line in
             (stale / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(12))
  assert os.listdir(stale / "checkpoints")
  assert f"metrics in {os.path.join('runs', 'demo', 'metrics.jsonl')}" in (
      run.stdout)


def test_the_demo_leaves_a_directory_it_did_not_write_alone(tmp_path):
  foreign = tmp_path / "runs" / "demo"
  foreign.mkdir(parents=True)
  (foreign / "mine.txt").write_text("a user's file")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  run = subprocess.run(
      [sys.executable, os.path.join(rc.REPO_ROOT, "scripts", "train.py")],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 2, run.stdout + run.stderr
  assert "was not written by the demo" in run.stderr
  assert (foreign / "mine.txt").read_text() == "a user's file"


def test_every_readme_command_is_one_the_tests_know_and_parses():
  launcher_flags = _launcher_flag_names()
  maxtext_ab = _maxtext_ab_parser()
  seen = set()
  for command, words in _all_commands():
    if words[0] == "export" or rc.is_assignment(command):
      continue
    if words[:2] == ["pip", "install"]:
      extras = rc.pip_extras(words)
      assert extras and set(extras) <= rc.setup_extras(), command
      seen.add("pip")
    elif words[:3] == ["python", "-m", "collective_matmul.integrations.maxtext"]:
      for word in words[3:]:
        if word.startswith("-"):
          name = word.lstrip("-").partition("=")[0]
          name = name[2:] if name.startswith("no") and name[2:] in (
              launcher_flags) else name
          assert name in launcher_flags, (word, command)
        else:
          # MaxText's own: the base file, then key=value.
          assert (word.endswith(".yml") or re.fullmatch(
              r"[a-z_][a-z0-9_]*=\S*", word)), (word, command)
      seen.add("launcher")
    elif words[:2] == ["python", "scripts/maxtext_ab.py"]:
      args = maxtext_ab.parse_args(words[2:])
      assert args.maxtext_args[0] == "--"
      assert args.maxtext_args[1].endswith("base.yml"), command
      seen.add("maxtext_ab")
    elif words[:2] == ["python", "scripts/train.py"] or words[:3] == [
        "python", "-m", "pytest"]:
      seen.add("quickstart")  # Run by the Quickstart test above.
    else:
      pytest.fail(f"README command no test runs or parses: {command}")
  assert seen == {"pip", "launcher", "maxtext_ab", "quickstart"}


def test_the_python_example_is_valid_and_names_only_what_cm_exports():
  (block,) = rc.blocks("python")
  tree = ast.parse(block)
  used = {node.attr for node in ast.walk(tree)
          if isinstance(node, ast.Attribute)
          and isinstance(node.value, ast.Name) and node.value.id == "cm"}
  assert used and all(hasattr(cm, name) for name in used), used


def _slug(heading):
  """GitHub's anchor of a heading."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", ["README.md", "docs/ADVANCED.md",
                                 "docs/TUNING.md", "BUILD.md"])
def test_every_relative_link_and_its_anchor_resolve(doc):
  path = os.path.join(rc.REPO_ROOT, doc)
  with open(path) as f:
    text = f.read()
  broken = []
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if target.startswith(("http://", "https://", "mailto:")):
      continue
    file_part, _, anchor = target.partition("#")
    linked = (os.path.normpath(os.path.join(os.path.dirname(path), file_part))
              if file_part else path)
    if not os.path.exists(linked):
      broken.append(target)
      continue
    if anchor:
      with open(linked) as f:
        headings = {_slug(h) for h in re.findall(r"^#+ (.*)$", f.read(),
                                                 re.M)}
      if anchor not in headings:
        broken.append(target)
  assert not broken, broken
