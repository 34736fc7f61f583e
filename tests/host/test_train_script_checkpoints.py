"""scripts/train.py when a run is killed, interrupted, diverges, or meets a
checkpoint of another run."""
import os
import re
import signal
import subprocess
import sys
import time

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
