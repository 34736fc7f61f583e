"""The MaxText wheel scripts (issue 33): scripts/fetch_maxtext_wheels.sh
pins every wheel's sha256, and scripts/gpu_maxtext_ab.sh installs them
into a fresh private directory, not a fixed one under the shared temp
folder. Both run here with fake `python3`/`nvidia-smi` on PATH."""
import hashlib
import os
import re
import shutil
import json
import stat
import subprocess
import sys

import pytest

from host_test_utils import REPO_ROOT

SCRIPTS = os.path.join(REPO_ROOT, "scripts")


def _executable(path, text):
  with open(path, "w") as f:
    f.write(text)
  os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)


def test_every_carried_wheel_is_pinned_by_sha256():
  lines = [re.sub(r"#.*", "", x).strip()
           for x in open(os.path.join(SCRIPTS, "maxtext_wheels.txt"))]
  lines = [x for x in lines if x]
  assert len(lines) == 31
  for line in lines:
    assert re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+ "
                        r"--hash=sha256:[0-9a-f]{64}", line), line


# A fake `python -m pip download ... -d DEST -r LIST`: writes each listed
# wheel into DEST with the content $FAKE_CONTENT_<name> (default "<name>"),
# and logs its arguments.
_FAKE_PIP = f"#!{sys.executable}\n" + r"""
import os, re, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
  f.write(" ".join(args) + "\n")
dest, lst = args[args.index("-d") + 1], args[args.index("-r") + 1]
for line in open(lst):
  spec = re.sub(r"#.*", "", line).split()
  if not spec:
    continue
  name, ver = spec[0].split("==")
  with open(os.path.join(dest, f"{name}-{ver}-py3-none-any.whl"), "w") as w:
    w.write(os.environ.get("FAKE_CONTENT_" + name, name))
"""


@pytest.fixture
def fetch(tmp_path):
  """A checkout holding only the fetch script and a 2-wheel list, and a
  function running it with the fake pip; returns (root, run)."""
  root = tmp_path / "repo"
  (root / "scripts").mkdir(parents=True)
  shutil.copy(os.path.join(SCRIPTS, "fetch_maxtext_wheels.sh"),
              root / "scripts")
  fake = tmp_path / "fake_python"
  _executable(fake, _FAKE_PIP)
  log = tmp_path / "pip.log"

  def write_list(*lines):
    (root / "scripts" / "maxtext_wheels.txt").write_text(
        "# carried wheels\n" + "\n".join(lines) + "\n")

  def run(**env):
    return subprocess.run(
        ["bash", str(root / "scripts" / "fetch_maxtext_wheels.sh")],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHON": str(fake), "FAKE_LOG": str(log),
             **env})

  sha = lambda text: hashlib.sha256(text.encode()).hexdigest()
  write_list(f"alpha==1.0 --hash=sha256:{sha('alpha')}",
             f"beta==2.0 --hash=sha256:{sha('beta')}")
  return root, write_list, run, log, sha


def test_fetch_downloads_with_require_hashes_and_checks_each_wheel(fetch):
  root, _, run, log, _ = fetch
  (root / ".whl").mkdir()
  (root / ".whl" / "gamma-0.1-py3-none-any.whl").write_text("stale")
  result = run()
  assert result.returncode == 0, result.stderr
  assert "2 wheels" in result.stdout and "sha256 checked" in result.stdout
  assert "removing gamma-0.1-py3-none-any.whl" in result.stdout
  assert "--require-hashes" in log.read_text().split()
  assert sorted(os.listdir(root / ".whl")) == [
      "alpha-1.0-py3-none-any.whl", "beta-2.0-py3-none-any.whl"]


def test_fetch_refuses_a_wheel_whose_hash_differs(fetch):
  root, _, run, _, sha = fetch
  result = run(FAKE_CONTENT_beta="tampered")
  assert result.returncode == 1
  assert f"beta-2.0-py3-none-any.whl has sha256 {sha('tampered')}" in (
      result.stderr)
  assert os.listdir(root / ".whl") == ["alpha-1.0-py3-none-any.whl"]


def test_fetch_refuses_a_line_without_a_hash_before_downloading(fetch):
  _, write_list, run, log, sha = fetch
  write_list(f"alpha==1.0 --hash=sha256:{sha('alpha')}", "beta==2.0")
  result = run()
  assert result.returncode == 1
  assert "no sha256 for beta==2.0" in result.stderr
  assert not log.exists()


# A fake python3 for gpu_maxtext_ab.sh: `-m pip install --target SITE`
# makes SITE/maxtext/configs/base.yml; `scripts/maxtext_ab.py --out DIR ...`
# records PYTHONPATH and its config argument and writes DIR/ab.json.
_FAKE_PYTHON3 = f"#!{sys.executable}\n" + r"""
import json, os, sys
args = sys.argv[1:]
if args[:3] == ["-m", "pip", "install"]:
  site = args[args.index("--target") + 1]
  os.makedirs(os.path.join(site, "maxtext", "configs"), exist_ok=True)
  open(os.path.join(site, "maxtext", "configs", "base.yml"), "w").close()
  sys.exit(0)
assert args[0] == "scripts/maxtext_ab.py", args
out = args[args.index("--out") + 1]
config = args[args.index("--") + 1]
os.makedirs(out, exist_ok=True)
site = os.environ["PYTHONPATH"].split(":")[0]
with open(os.path.join(out, "ab.json"), "w") as f:
  json.dump({"pythonpath": os.environ["PYTHONPATH"], "config": config,
             "config_exists": os.path.exists(config),
             "private_mode": oct(
                 os.stat(os.path.dirname(site)).st_mode & 0o777)}, f)
"""


def test_gpu_maxtext_ab_uses_a_fresh_private_site_removed_on_exit(tmp_path):
  bin_dir, temp = tmp_path / "bin", tmp_path / "tmp"
  bin_dir.mkdir()
  temp.mkdir()
  _executable(bin_dir / "python3", _FAKE_PYTHON3)
  _executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho GPU 0\necho GPU 1\n")
  env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
         "TMPDIR": str(temp)}
  sites = []
  for i in range(2):
    out = tmp_path / f"out{i}"
    result = subprocess.run(
        ["bash", os.path.join(SCRIPTS, "gpu_maxtext_ab.sh"), str(out)],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    ab = json.loads((out / "ab.json").read_text())
    site = ab["pythonpath"].split(":")[0]
    assert os.path.dirname(os.path.dirname(site)) == str(temp), site
    assert ab["config"] == os.path.join(site, "maxtext", "configs",
                                        "base.yml")
    assert ab["config_exists"] and ab["private_mode"] == "0o700"
    sites.append(site)
  assert sites[0] != sites[1]
  assert not os.listdir(temp)  # Both removed on exit.
