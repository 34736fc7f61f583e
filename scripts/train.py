r"""Trains the reference LLaMA-style model, MaxText style.

  python scripts/train.py model_configs/base.yml model_name=tiny steps=5 \
      ici_tensor_sequence_parallelism=2 --use_collective_matmul

The first argument is the base config, then key=value overrides
(`model_name=NAME` applies `model_configs/NAME.yml`), then absl flags: the
plugin's (`--use_collective_matmul`, `--collective_matmul_impl`,
`--collective_matmul_strict`) and this script's.

With no arguments at all it runs the built-in demo: the tiny model for a few
steps on 8 emulated CPU devices (data 2 x tensor 4, sequence-parallel) with
the collective matmul on, then checks the loss against the same run with it
off, and prints which layers were rewritten. Its checkpoints and
metrics.jsonl go to runs/demo under the current directory, replaced by the
next demo.
"""
from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging as py_logging
import os
import shutil
import signal
import sys
import warnings

import script_setup  # pylint: disable=g-bad-import-order

script_setup.prepare()
REPO_ROOT = script_setup.REPO_ROOT

from absl import flags  # pylint: disable=g-import-not-at-top
from absl import logging
import jax

import collective_matmul as cm
from reference_host import ab as ab_lib
from reference_host import checkpoint as checkpoint_lib
from reference_host import config as config_lib
from reference_host import metrics as metrics_lib
from reference_host import model as model_lib
from reference_host import trainer as trainer_lib

_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False,
    "Call jax.distributed.initialize() first (multi-process launch; the "
    "coordinator and process ids come from the environment, e.g. SLURM or "
    "JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID).")
_CHECK_BASELINE = flags.DEFINE_bool(
    "check_against_baseline", False,
    "Also train with the collective matmul off, from the same init and data, "
    "and fail unless the losses agree within the dtype's tolerance.")

DEFAULT_BASE_CONFIG = os.path.join(REPO_ROOT, "model_configs", "base.yml")
# The demo that `python scripts/train.py` runs: about a minute on 2 CPU cores.
DEFAULT_DEMO_ARGS = ("model_name=tiny", "steps=12", "log_period=3",
                     "ici_data_parallelism=2",
                     "ici_tensor_sequence_parallelism=4",
                     "checkpoint_period=6")


def _log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


# Marks a run directory as the demo's own, so the next demo may replace it.
_DEMO_MARKER = ".reference_host_demo"


def _fresh_demo_directory(config: config_lib.Config) -> str:
  """`<base_output_directory>/demo`, emptied if an earlier demo wrote it (a
  directory of that name the demo did not write is refused)."""
  run_dir = os.path.join(config.base_output_directory, config.run_name)
  if os.path.exists(run_dir):
    if not os.path.exists(os.path.join(run_dir, _DEMO_MARKER)):
      raise config_lib.ConfigError(
          f"the demo writes to {run_dir}, which exists and was not written by "
          "the demo: move it, or run the demo from another directory")
    shutil.rmtree(run_dir)
  os.makedirs(run_dir)
  with open(os.path.join(run_dir, _DEMO_MARKER), "w") as f:
    f.write("written by scripts/train.py's demo; replaced by the next one\n")
  return run_dir


def _demo(base_args: list[str]) -> int:
  """Collective matmul on vs off on the tiny model; returns the exit code."""
  args = [*base_args, "run_name=demo"]
  config = config_lib.load_config(args, num_devices=jax.device_count())
  run_dir = _fresh_demo_directory(config)
  collective_config = dataclasses.replace(cm.get_config(), enabled=True)
  mesh_text = " x ".join(f"{axis}={size}" for axis, size in
                         config.mesh_axis_sizes.items() if size > 1)
  _log(f"demo: tiny llama on {jax.device_count()} {jax.devices()[0].platform}"
       f" devices, mesh {mesh_text} (sequence parallel), {config.steps} "
       "steps, collective matmul on vs off")
  collective_trainer = trainer_lib.Trainer(config, collective_config)
  checkpointer = checkpoint_lib.Checkpointer(collective_trainer.config,
                                             log=_log)
  state = collective_trainer.init_state()
  baseline_trainer = trainer_lib.Trainer(
      config, cm.CollectiveMatmulConfig(enabled=False))
  baseline_state = jax.tree.map(lambda x: x.copy(), state)

  _log("--- with --use_collective_matmul")
  metrics = metrics_lib.MetricsWriter(run_dir)
  try:
    result = collective_trainer.train(state, checkpointer=checkpointer,
                                      log=_log, on_record=metrics.write)
  finally:
    metrics.close()
  _log("--- baseline (flag off), same init and data")
  baseline = baseline_trainer.train(baseline_state, log=_log)

  _log(f"--- layers ({collective_config.impl}):")
  _log(cm.format_decisions(result.decisions))
  diffs = [abs(c - b) / abs(b) for b, c in zip(baseline.losses, result.losses)]
  tolerance = ab_lib.DEFAULT_RELATIVE_LOSS_TOLERANCE[config.dtype]
  matches = max(diffs) <= tolerance
  _log(f"--- loss {'matches' if matches else 'DOES NOT match'} the baseline: "
       f"max relative difference {max(diffs):.2e} over {len(diffs)} steps "
       f"(tolerance {tolerance:.0e}); final loss {result.losses[-1]:.5f} vs "
       f"{baseline.losses[-1]:.5f}")
  _log(f"--- checkpoints (orbax) in {checkpointer.directory}: steps "
       f"{checkpointer.all_steps()}; metrics in {metrics.jsonl_path} (the "
       "next demo replaces them)")
  rewritten = sum(d.rewritten for d in result.decisions)
  if not rewritten:
    _log("--- no layer was rewritten: the demo did not exercise the plugin")
  return 0 if matches and rewritten else 1


def _with_run_name(config: config_lib.Config) -> config_lib.Config:
  """An explicit run_name resumes that run; without one (base.yml's empty
  default) this run gets a fresh timestamped name and directory."""
  named = checkpoint_lib.with_default_run_name(config)
  if named.run_name != config.run_name:
    _log(f"run_name not set: this run is {named.run_name!r} (pass "
         f"run_name={named.run_name} to resume it)")
  return named


def _train(argv: list[str]) -> int:
  # Key and value errors before JAX starts; the shardings' divisibility
  # waits for the device count, so a mesh larger than the machine is
  # reported as that, not as a dimension its size does not divide.
  config_lib.load_config(argv, check_shardings=False)
  config = config_lib.load_config(argv, num_devices=jax.device_count())
  # A model beyond the machine's memory is refused before anything is
  # allocated or written.
  trainer_lib.check_fits_memory(config, jax.devices())
  config = _with_run_name(config)
  # Before the first step: the run's directory is writable, and this is its
  # only writer (the Checkpointer checks and locks its own directory too).
  run_lock = None
  if jax.process_index() == 0:
    run_dir = checkpoint_lib.check_writable_directory(
        os.path.join(config.base_output_directory, config.run_name),
        "output directory")
    run_lock = checkpoint_lib.RunLock(run_dir, log=_log).acquire()
  try:
    return _train_locked(config)
  finally:
    if run_lock is not None:
      run_lock.release()


def _train_locked(config: config_lib.Config) -> int:
  collective_config = cm.get_config()
  trainer = trainer_lib.Trainer(config, collective_config)
  config = trainer.config
  mesh_text = " x ".join(f"{axis}={size}" for axis, size in
                         config.mesh_axis_sizes.items() if size > 1)
  _log(f"model {config.model_name}: {model_lib.count_params(config) / 1e6:.1f}"
       f"M params, mesh {mesh_text or 'of one device'} on {jax.device_count()} "
       f"{jax.devices()[0].device_kind} devices ({jax.process_count()} "
       f"process{'es' if jax.process_count() > 1 else ''}), global batch "
       f"{config.global_batch_size} x "
       f"{config.max_target_length}; collective matmul "
       f"{'on (' + collective_config.impl + ')' if collective_config.enabled else 'off'}")
  checkpointer = None
  if config.enable_checkpointing:
    checkpointer = checkpoint_lib.Checkpointer(config, log=_log)
  try:
    return _train_with(config, trainer, collective_config, checkpointer)
  finally:
    if checkpointer is not None:
      checkpointer.close()


def _train_with(config, trainer, collective_config, checkpointer) -> int:
  if checkpointer is not None:
    state, resumed = trainer.restore_or_init(checkpointer)
    _log(f"resumed from checkpoint step {resumed} in {checkpointer.directory}"
         if resumed is not None else
         f"no checkpoint in {checkpointer.directory}: fresh init")
  else:
    state = trainer.init_state()
  trainer.compile()
  _log(f"compiled the train step in {trainer.compile_time_s:.1f} s")
  if collective_config.enabled:
    _log(cm.format_decisions(trainer.decisions))
    if not any(d.rewritten for d in trainer.decisions):
      _log("note: nothing was rewritten. The collective matmul needs "
           "activations sharded on rows over the mesh axis that shards the "
           "weights' output features: tensor-sequence parallelism "
           "(ici_tensor_sequence_parallelism > 1). The reasons are above.")
  baseline_state = None
  if _CHECK_BASELINE.value:
    baseline_state = jax.tree.map(lambda x: x.copy(), state)
  metrics = None
  if jax.process_index() == 0:
    metrics = metrics_lib.MetricsWriter(os.path.join(
        config.base_output_directory, config.run_name))
    _log(f"metrics: {metrics.jsonl_path}, TensorBoard events in "
         f"{metrics.tensorboard_dir}")
  try:
    result = trainer.train(state, checkpointer=checkpointer, log=_log,
                           on_record=metrics.write if metrics else None)
  except BaseException:
    if metrics is not None:
      # The error in flight is the one to report (on a full disk, closing
      # the metrics files fails too).
      with contextlib.suppress(OSError):
        metrics.close()
    raise
  if metrics is not None:
    metrics.close()
  if result.records:
    times = trainer_lib.summarize_step_times(result.step_times)
    _log(f"done: steps {result.first_step}..{result.records[-1].step}, "
         f"median step time {1e3 * times['median_s']:.1f} ms, final loss "
         f"{result.losses[-1]:.5f}")
  else:
    _log(f"nothing to do: already at step {result.first_step} >= steps="
         f"{config.steps}")
  if baseline_state is not None and result.records:
    baseline = trainer_lib.Trainer(
        config, cm.CollectiveMatmulConfig(enabled=False)).train(
            baseline_state, log=None)
    diffs = [abs(c - b) / abs(b)
             for b, c in zip(baseline.losses, result.losses)]
    tolerance = ab_lib.DEFAULT_RELATIVE_LOSS_TOLERANCE[config.dtype]
    _log(f"baseline check: max relative loss difference {max(diffs):.2e} "
         f"(tolerance {tolerance:.0e})")
    if max(diffs) > tolerance:
      return 1
  return 0


def distributed_error(error: Exception) -> str:
  """One line for a failed jax.distributed.initialize()."""
  first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
  return (f"--distributed: jax.distributed.initialize() failed: {first_line} "
          "(set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
          "JAX_PROCESS_ID, or launch under a cluster JAX detects, e.g. SLURM; "
          "a single-process run needs no --distributed)")


def _is_strict_fallback(error: BaseException) -> bool:
  """The plugin's strict mode refusing a fallback."""
  return isinstance(error, cm.StrictFallbackError)


def main(argv: list[str]) -> int:
  # A run that seems stuck: `kill -USR1 <pid>` prints every thread's stack
  # to stderr (and the run goes on).
  faulthandler.register(signal.SIGUSR1, all_threads=True)
  if not flags.FLAGS["verbosity"].present:
    # Quiet by default: progress lines and the decision table on stdout;
    # --verbosity=0 shows JAX's and orbax's INFO log, --v=1 each decision.
    logging.set_verbosity(logging.WARNING)
    # orbax logs a failed save with its traceback before raising it; the
    # Checkpointer reports that failure in one line (path and cause).
    logging.get_absl_handler().addFilter(_OrbaxErrorsReportedByUs())
    # asyncio's "exception was never retrieved" here only ever concerns
    # orbax's writes, whose failure the Checkpointer reports in one line;
    # logged when a future is collected, it could race past the filter's
    # reading of its text. --verbosity shows them.
    py_logging.getLogger("asyncio").setLevel(py_logging.CRITICAL)
    _drop_closed_loop_callbacks()
  if _DISTRIBUTED.value:
    try:
      jax.distributed.initialize()
    except (ValueError, RuntimeError) as e:
      print(distributed_error(e), file=sys.stderr)
      return 2
  cm.set_config(cm.config_from_flags())
  args = argv[1:]
  try:
    if not args and len(sys.argv) == 1:
      return _demo([DEFAULT_BASE_CONFIG, *DEFAULT_DEMO_ARGS])
    if not args:
      raise config_lib.ConfigError(
          "expected a config file as the first argument, e.g. "
          "model_configs/base.yml model_name=tiny")
    return _train(args)
  except config_lib.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  except checkpoint_lib.StorageError as e:
    print(f"storage error: {e}", file=sys.stderr)
    _quiet_abandoned_writes()
    return 1
  except checkpoint_lib.RunLockedError as e:
    print(f"refused: {e}", file=sys.stderr)
    return 1
  except checkpoint_lib.CheckpointError as e:
    print(f"checkpoint error: {e}", file=sys.stderr)
    return 1
  except trainer_lib.NonFiniteError as e:
    print(f"training stopped: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt as e:  # trainer_lib.TrainingInterrupted too
    print(str(e) or "interrupted (Ctrl-C)", file=sys.stderr)
    return 128 + getattr(e, "signum", signal.SIGINT)
  except OSError as e:
    cause = checkpoint_lib.storage_cause(e)
    if cause is None:
      raise
    where = e.filename or "the output"
    print(f"storage error: cannot write {where}: {cause}", file=sys.stderr)
    _quiet_abandoned_writes()
    return 1
  except ValueError as e:
    if not _is_strict_fallback(e):
      raise
    print(f"{str(e).splitlines()[0]} (--collective_matmul_strict refuses a "
          "fallback; without it the layer falls back as recorded)",
          file=sys.stderr)
    return 1


def _quiet_abandoned_writes() -> None:
  """After a failed checkpoint write, orbax's async writes that never ran
  are collected at exit with "coroutine ... was never awaited"
  (RuntimeWarning, depending on when the collector runs): noise after the
  one-line storage error, so left unsaid."""
  warnings.filterwarnings("ignore", message="coroutine .* was never awaited",
                          category=RuntimeWarning)


def _is_closed_loop_callback(error: BaseException | None) -> bool:
  """TensorStore finishing a write for orbax after orbax's event loop has
  closed (its save failed, and was reported in one line)."""
  return (isinstance(error, RuntimeError)
          and str(error) == "Event loop is closed")


def _drop_closed_loop_callbacks() -> None:
  """Python prints those callbacks' RuntimeError as tracebacks, one per
  write still in flight (dozens on a full disk); any other error is printed
  as before."""
  excepthook, unraisablehook = sys.excepthook, sys.unraisablehook

  def quiet_excepthook(kind, error, traceback):
    if not _is_closed_loop_callback(error):
      excepthook(kind, error, traceback)

  def quiet_unraisablehook(unraisable):
    if not _is_closed_loop_callback(unraisable.exc_value):
      unraisablehook(unraisable)

  sys.excepthook, sys.unraisablehook = quiet_excepthook, quiet_unraisablehook


class _OrbaxErrorsReportedByUs(py_logging.Filter):
  """Drops orbax's logged errors with tracebacks, and asyncio's 'exception
  was never retrieved' for its other writes that failed on a full or
  read-only disk: the exception reaches the Checkpointer, which reports it
  in one line."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.levelno < py_logging.ERROR:
      return True
    if record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname:
      return False
    return not (record.name == "asyncio" and "never retrieved" in (
        message := record.getMessage()) and checkpoint_lib.storage_cause(
            RuntimeError(message)) is not None)


# The plugin's flags are this program's own: listed by --help, not only
# --helpfull.
flags.adopt_module_key_flags(cm.flags)

if __name__ == "__main__":
  script_setup.run_app(main)
