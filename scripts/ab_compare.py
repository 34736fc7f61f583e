r"""A/B: the same training run with the collective matmul off and on.

  python scripts/ab_compare.py model_configs/base.yml model_name=tiny steps=10 \
      ici_tensor_sequence_parallelism=4 --collective_matmul_impl=ring

Same config arguments as train.py. Both arms start from one init and see the
same batches; their steps are interleaved. Writes report.md (per-step loss
difference, step-time median and spread with their ratio, rewritten layers),
ab.json (the raw numbers and the command) and ab.png (loss curves, step-time
distributions) to --output_dir (default <base_output_directory>/ab/<tag>/,
with -2, -3, ... added rather than overwriting an earlier report). The
collective arm uses the plugin's flags with `enabled` forced on; the
baseline arm is the plugin off, compiled with XLA's defaults or with the
`--baseline_xla_option`s given (e.g. XLA's windowed einsum).

Exit status: 0 when the losses match, 1 when they do not, 3 when the plugin
rewrote nothing (the mesh has no pattern: both arms ran the same program),
2 when an argument or the output location is refused (before the first
arm).
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile

import script_setup  # pylint: disable=g-bad-import-order

script_setup.prepare()

from absl import flags
from absl import logging
import jax

import collective_matmul as cm
from reference_host import ab as ab_lib
from reference_host import checkpoint as checkpoint_lib
from reference_host import config as config_lib

_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", None, "Where the report goes; default "
    "<base_output_directory>/ab/<tag>/ (never overwritten: -2, -3, ...).")
_TAG = flags.DEFINE_string(
    "tag", None, "Names the default output dir; default "
    "<model>-<device>-<mesh>-<impl>.")
_TOLERANCE = flags.DEFINE_float(
    "relative_loss_tolerance", None,
    "Largest per-step |loss diff| / |baseline loss| that passes; default by "
    "dtype.")
_PROFILE_STEPS = flags.DEFINE_integer(
    "profile_steps", 0,
    "After the timed steps, run this many more per arm under the JAX "
    "profiler and report where each arm's GPU time goes (matmuls, collective "
    "matmul kernels, NCCL and how much of it no compute overlaps, ...). GPU "
    "only; the traces go to <output_dir>/traces/.")
_BASELINE_XLA_OPTION = flags.DEFINE_multi_string(
    "baseline_xla_option", [],
    "NAME=VALUE: compile the baseline arm with this XLA option (repeatable), "
    "e.g. XLA's windowed einsum: "
    "--baseline_xla_option=xla_gpu_threshold_for_windowed_einsum_mib=0 "
    "--baseline_xla_option=xla_gpu_multi_streamed_windowed_einsum=true")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() first.")


def main(argv: list[str]) -> int:
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # --verbosity=0: INFO logs too.
  if _DISTRIBUTED.value:
    try:
      jax.distributed.initialize()
    except (ValueError, RuntimeError) as e:
      print(f"--distributed: jax.distributed.initialize() failed: "
            f"{(str(e).strip().splitlines() or [type(e).__name__])[0]} (set "
            "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, or "
            "launch under a cluster JAX detects, e.g. SLURM)", file=sys.stderr)
      return 2
  try:
    ab_lib.check_relative_tolerance(_TOLERANCE.value)
  except ValueError as e:
    print(f"--relative_loss_tolerance: {e}", file=sys.stderr)
    return 2
  if len(argv) < 2:
    print("usage: ab_compare.py <base.yml> [key=value ...] [--flags]",
          file=sys.stderr)
    return 2
  try:
    config = config_lib.load_config(argv[1:], num_devices=jax.device_count())
  except config_lib.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  if _PROFILE_STEPS.value < 0:
    print(f"--profile_steps={_PROFILE_STEPS.value} must be >= 0",
          file=sys.stderr)
    return 2
  if _PROFILE_STEPS.value and jax.default_backend() != "gpu":
    print(f"--profile_steps breaks down GPU kernel time; this run's backend "
          f"is {jax.default_backend()!r}", file=sys.stderr)
    return 2
  try:
    baseline_options = ab_lib.parse_xla_options(_BASELINE_XLA_OPTION.value)
    ab_lib.check_xla_options(baseline_options)
  except ValueError as e:
    print(f"--baseline_xla_option: {e}", file=sys.stderr)
    return 2
  if jax.process_index() == 0:
    # Before the first arm: where the report goes is a writable directory.
    try:
      checkpoint_lib.check_writable_directory(
          _OUTPUT_DIR.value or os.path.join(config.base_output_directory,
                                            "ab"),
          "--output_dir" if _OUTPUT_DIR.value else "report directory")
    except checkpoint_lib.StorageError as e:
      print(f"storage error: {e}", file=sys.stderr)
      return 2
  command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
  profile_dir = (tempfile.mkdtemp(prefix="profile-", dir=_mkdirs(
      os.path.join(config.base_output_directory, "ab")))
                 if _PROFILE_STEPS.value else None)
  result = ab_lib.run_ab(config, cm.config_from_flags(),
                         relative_tolerance=_TOLERANCE.value,
                         log=print if jax.process_index() == 0 else None,
                         profile_steps=_PROFILE_STEPS.value,
                         profile_dir=profile_dir,
                         baseline_compiler_options=baseline_options)
  if jax.process_index() == 0:
    output_dir = _OUTPUT_DIR.value or _fresh_dir(os.path.join(
        config.base_output_directory, "ab",
        _TAG.value or ab_lib.default_tag(result)))
    if profile_dir:
      _move_traces(result, profile_dir, os.path.join(output_dir, "traces"))
    paths = ab_lib.write_report(result, output_dir, command=command)
    print(ab_lib.summary(result))
    print("wrote " + ", ".join(paths.values()))
  if not result.rewritten_layers:
    print(f"warning: the collective matmul rewrote none of the "
          f"{len(result.decisions)} dot_generals, so both arms ran the same "
          "program and the step-time ratio means nothing. The pattern needs "
          "activations sharded on rows over the axis that shards the weights' "
          "output features: set ici_tensor_sequence_parallelism > 1. Why each "
          "was left: see report.md.", file=sys.stderr)
    return 3
  return 0 if result.losses_match else 1


def _mkdirs(path: str) -> str:
  os.makedirs(path, exist_ok=True)
  return path


def _move_traces(result, profile_dir: str, traces_dir: str) -> None:
  """Moves the arms' profiler dirs under the report's `traces/`."""
  os.makedirs(os.path.dirname(traces_dir), exist_ok=True)
  shutil.move(profile_dir, traces_dir)
  result.profile["traces"] = {
      arm: os.path.join(traces_dir, os.path.relpath(path, profile_dir))
      for arm, path in result.profile["traces"].items()}


def _fresh_dir(path: str) -> str:
  """`path`, or `path-2`, `path-3`, ... if it already holds a report (or
  is not a directory)."""
  candidate, n = path, 1
  while (os.path.exists(os.path.join(candidate, "report.md"))
         or os.path.lexists(candidate) and not os.path.isdir(candidate)):
    n += 1
    candidate = f"{path}-{n}"
  return candidate


flags.adopt_module_key_flags(cm.flags)  # The plugin's flags in --help.

if __name__ == "__main__":
  script_setup.run_app(main)
