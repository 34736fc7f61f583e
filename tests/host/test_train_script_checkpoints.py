"""scripts/train.py when a run is killed, interrupted, diverges, or meets a
checkpoint of another run."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from reference_host import checkpoint as checkpoint_lib

from host_test_utils import REPO_ROOT

TRAIN = os.path.join(REPO_ROOT, "scripts", "train.py")
COMMON = ("model_configs/base.yml", "model_name=tiny",
          "base_num_decoder_layers=1", "max_target_length=32")


def _env():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the script chooses its own device count
  return env


def _run(*args, timeout=300):
  return subprocess.run([sys.executable, TRAIN, *COMMON, *args],
                        cwd=REPO_ROOT, env=_env(), capture_output=True,
                        text=True, timeout=timeout)


def _unfinished_saves(directory):
  if not os.path.isdir(directory):
    return []
  return [name for name in os.listdir(directory)
          if checkpoint_lib.UNFINISHED_SAVE_MARKER in name]


def _steps(directory):
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory)
                if name.isdigit())


def _start_and_catch_a_save(tmp_path, *args):
  """Starts a long run saving every step; returns (process, its checkpoint
  directory, its stdout/stderr paths) as soon as a save is in flight after
  two finished ones."""
  out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
  # Ctrl-C as in a terminal, even when this suite runs in the background of
  # a non-interactive shell: that ignores SIGINT, a child inherits the
  # ignore and its Python keeps it. A handler instead is reset to the
  # default in the child.
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with open(out, "w") as stdout, open(err, "w") as stderr:
      process = subprocess.Popen(
          [sys.executable, TRAIN, *COMMON,
           f"base_output_directory={tmp_path}", "run_name=long",
           "checkpoint_period=1", "steps=1000", *args],
          cwd=REPO_ROOT, env=_env(), stdout=stdout, stderr=stderr)
  finally:
    signal.signal(signal.SIGINT, previous)
  directory = os.path.join(tmp_path, "long", "checkpoints")
  deadline = time.monotonic() + 240
  while len(_steps(directory)) < 2 or not _unfinished_saves(directory):
    if process.poll() is not None or time.monotonic() > deadline:
      process.kill()
      raise AssertionError(f"no save seen in flight:\n{err.read_text()}")
    time.sleep(0.0005)
  return process, directory, out, err


def test_killed_during_a_save_then_resumes(tmp_path):
  """SIGKILL while orbax writes a step; the next start removes the unfinished
  save and resumes from the newest intact step; a resume with another model
  is then refused in one line."""
  process, directory, _, _ = _start_and_catch_a_save(tmp_path)
  process.send_signal(signal.SIGKILL)
  process.wait(timeout=60)
  leftovers = _unfinished_saves(directory)
  # Sealed steps, and a step orbax finished that the kill left unsealed: the
  # restart verifies its content and seals it.
  intact = [step for step in _steps(directory)
            if checkpoint_lib.verify_step(
                os.path.join(directory, str(step))) is None
            or checkpoint_lib.unsealed_step_problem(
                os.path.join(directory, str(step))) is None]
  newest_seen = max(_steps(directory) + [
      int(name.split(".")[0]) for name in leftovers])
  steps = newest_seen + 2

  resumed = _run(f"base_output_directory={tmp_path}", "run_name=long",
                 "checkpoint_period=1", f"steps={steps}")
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  for name in leftovers:
    assert ("removed an unfinished save (its run was stopped while saving): "
            f"{os.path.join(directory, name)}") in resumed.stdout
  assert f"resumed from checkpoint step {intact[-1]} in" in resumed.stdout
  assert f"done: steps {intact[-1]}..{steps - 1}" in resumed.stdout
  assert not _unfinished_saves(directory)
  assert _steps(directory)[-1] == steps
  for step in _steps(directory):
    assert checkpoint_lib.verify_step(
        os.path.join(directory, str(step))) is None

  refused = _run(f"base_output_directory={tmp_path}", "run_name=long",
                 f"steps={steps + 1}", "base_emb_dim=128")
  assert refused.returncode == 1, refused.stdout + refused.stderr
  assert "Traceback" not in refused.stderr
  lines = [line for line in refused.stderr.splitlines()
           if line.startswith("checkpoint error: ")]
  assert len(lines) == 1, refused.stderr
  assert "base_emb_dim: 64 in the checkpoint, 128 now" in lines[0]
  assert directory in lines[0]


def _wait_or_dump_stacks(process, err, timeout):
  """The exit code, or (a hang) a failure showing every thread's stack, which
  train.py prints on SIGUSR1."""
  try:
    return process.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    process.send_signal(signal.SIGUSR1)
    time.sleep(5)
    process.kill()
    process.wait()
    raise AssertionError(f"still running after {timeout} s; its threads:\n"
                         f"{err.read_text()[-20000:]}") from None


def test_ctrl_c_finishes_the_save_in_flight_with_one_line(tmp_path):
  process, directory, out, err = _start_and_catch_a_save(tmp_path)
  process.send_signal(signal.SIGINT)
  assert _wait_or_dump_stacks(process, err, 120) == 130, err.read_text()
  stderr = err.read_text()
  assert "Traceback" not in stderr, stderr
  stopped = re.findall(r"^interrupted \(Ctrl-C\) after step (\d+): newest "
                       r"checkpoint: step (\d+) in (\S+)$", stderr, re.M)
  assert len(stopped) == 1, stderr
  step, newest, where = stopped[0]
  assert int(newest) == int(step) + 1 and where == directory
  assert "done:" not in out.read_text()
  assert not _unfinished_saves(directory)
  assert _steps(directory)[-1] == int(newest)
  for saved in _steps(directory):
    assert checkpoint_lib.verify_step(
        os.path.join(directory, str(saved))) is None


def test_runs_without_run_name_do_not_resume_each_other(tmp_path):
  first = _run(f"base_output_directory={tmp_path}", "steps=1")
  second = _run(f"base_output_directory={tmp_path}", "steps=1")
  for run in (first, second):
    assert run.returncode == 0, run.stdout + run.stderr
    assert "run_name not set: this run is 'tiny-" in run.stdout
    assert "fresh init" in run.stdout
  runs = sorted(os.listdir(tmp_path))
  assert len(runs) == 2 and all(name.startswith("tiny-") for name in runs)
  assert all(os.path.isfile(tmp_path / name / "checkpoints" / "config.yml")
             for name in runs)


def test_diverging_run_exits_nonzero_with_one_line(tmp_path):
  run = _run(f"base_output_directory={tmp_path}", "run_name=diverge",
             "learning_rate=1e30", "checkpoint_period=1", "steps=6")
  assert run.returncode == 1, run.stdout + run.stderr
  assert "Traceback" not in run.stderr
  stopped = re.findall(r"^training stopped: .*step (\d+).*: stopped before "
                       r"saving.*$", run.stderr, re.M)
  assert len(stopped) == 1, run.stderr
  directory = os.path.join(tmp_path, "diverge", "checkpoints")
  assert _steps(directory) == list(range(1, int(stopped[0]) + 1))


def test_second_trainer_is_refused_and_sigterm_stops_the_first_cleanly(
    tmp_path):
  """Issue 33: a second trainer on the run used to delete the first's save
  in flight; now it is refused in one line naming the owner. SIGTERM (a
  scheduler's preemption) then stops the first like Ctrl-C: the step and
  its save finish, one line, exit 128 + 15 (it used to kill at once)."""
  process, directory, out, err = _start_and_catch_a_save(tmp_path)
  second = _run(f"base_output_directory={tmp_path}", "run_name=long",
                "checkpoint_period=1", "steps=3")
  assert second.returncode == 1, second.stdout + second.stderr
  assert "Traceback" not in second.stderr
  refused = [line for line in second.stderr.splitlines()
             if line.startswith("refused: ")]
  assert len(refused) == 1, second.stderr
  assert (f"{tmp_path / 'long'} is in use by another trainer: pid "
          f"{process.pid} on host {socket.gethostname()}") in refused[0]
  assert "removed an unfinished save" not in second.stdout
  assert process.poll() is None, err.read_text()

  process.send_signal(signal.SIGTERM)
  assert _wait_or_dump_stacks(process, err, 120) == 128 + signal.SIGTERM, (
      err.read_text())
  stderr = err.read_text()
  assert "Traceback" not in stderr, stderr
  stopped = re.findall(r"^interrupted \(SIGTERM\) after step (\d+): newest "
                       r"checkpoint: step (\d+) in (\S+)$", stderr, re.M)
  assert len(stopped) == 1, stderr
  step, newest, where = stopped[0]
  assert int(newest) == int(step) + 1 and where == directory
  assert not _unfinished_saves(directory)
  for saved in _steps(directory):
    assert checkpoint_lib.verify_step(
        os.path.join(directory, str(saved))) is None
  steps_in_metrics = [json.loads(line)["step"] for line in
                      (tmp_path / "long" / "metrics.jsonl").read_text()
                      .splitlines()]
  assert steps_in_metrics == list(range(int(step) + 1))


def test_output_directory_under_a_file_is_one_line(tmp_path):
  (tmp_path / "a_file").write_text("not a directory")
  run = _run(f"base_output_directory={tmp_path / 'a_file'}", "run_name=r",
             "steps=1")
  assert run.returncode == 1, run.stdout + run.stderr
  assert "Traceback" not in run.stderr, run.stderr
  assert run.stderr.strip().splitlines() == [
      f"storage error: cannot use {tmp_path / 'a_file' / 'r'} as the output "
      f"directory: {tmp_path / 'a_file'} is a file, not a directory (ENOTDIR)"]


def test_full_disk_is_one_line(tmp_path):
  """A checkpoint (1.3 MB) does not fit on a 512 KiB file system: one line
  naming the path and ENOSPC, where it used to be 2,100-2,600 lines."""
  disk = tmp_path / "disk"
  disk.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs",
                     str(disk)], capture_output=True,
                    check=False).returncode != 0:
    pytest.skip("needs a small tmpfs (mount as root); "
                "test_checkpoint_storage.py injects ENOSPC instead")
  try:
    run = _run(f"base_output_directory={disk}", "run_name=full", "steps=2",
               "checkpoint_period=1")
  finally:
    subprocess.run(["umount", "-l", str(disk)], check=False)
  assert run.returncode == 1, run.stdout + run.stderr
  assert "Traceback" not in run.stderr, run.stderr[-3000:]
  lines = run.stderr.strip().splitlines()
  assert len(lines) == 1, run.stderr[-3000:]
  assert lines[0].startswith(
      f"storage error: cannot write checkpoint step 1 to {disk}/full/"
      "checkpoints")
  assert lines[0].endswith("No space left on device (ENOSPC)")
