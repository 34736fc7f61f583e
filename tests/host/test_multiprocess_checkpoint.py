"""The checkpointer in a 2-process job (jax.distributed on CPU, gloo): the
paths that only run with several processes (process 0 checks, locks, seals
and decides; the others follow through a broadcast and barriers).

- a 2-process job saves, seals and closes (releasing the lock), and another
  2-process job restores the same values;
- a directory another live trainer holds is refused on both processes, in
  one line each, and neither hangs.
"""
import json
import os
import socket
import subprocess
import sys

from reference_host import checkpoint as checkpoint_lib

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 240


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _job(tmp_path, directory, scenario):
  """Both processes' results (they must both finish in TIMEOUT)."""
  port = str(_free_port())
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs, outs = [], []
  for pid in range(2):
    out = tmp_path / f"{scenario}_{pid}.json"
    procs.append(subprocess.Popen(
        [sys.executable, os.path.join(HERE, "multiprocess_checkpoint.py"),
         str(pid), port, str(directory), scenario, str(out)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs.append(out)
  try:
    logs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  return [json.loads(out.read_text()) for out in outs]


def test_two_processes_save_seal_and_restore(tmp_path):
  directory = tmp_path / "checkpoints"
  saved = _job(tmp_path, directory, "save")
  assert [r.get("ok") for r in saved] == [True, True], saved
  assert [r["saved"] for r in saved] == [True, True]
  step_dir = directory / "2"
  assert checkpoint_lib.verify_step(str(step_dir)) is None  # Sealed, intact.
  # Closed: the lock is free (an empty file), so one process can take it.
  assert (directory / checkpoint_lib.LOCK_FILE).read_text() == ""
  restored = _job(tmp_path, directory, "restore")
  assert [(r.get("ok"), r["step"], r["equal"]) for r in restored] == [
      (True, 2, True)] * 2, restored


def test_a_run_held_by_another_trainer_is_refused_on_every_process(
    tmp_path):
  directory = tmp_path / "checkpoints"
  directory.mkdir()
  with checkpoint_lib.RunLock(str(directory), what="checkpoints").acquire():
    results = _job(tmp_path, directory, "open")
  primary, other = results
  assert primary["error"] == "RunLockedError", primary
  assert f"pid {os.getpid()}" in primary["message"]
  assert "\n" not in primary["message"]
  assert other["error"] == "CheckpointError", other
  assert other["message"] == (
      f"process 0 could not open {directory} for checkpoints (its output "
      "says why)")
  assert not any(r.get("ok") for r in results)
  assert sorted(os.listdir(directory)) == [checkpoint_lib.LOCK_FILE]
