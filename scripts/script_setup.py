"""What the host scripts do before importing JAX (imported first by them)."""
import importlib.util
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prepare():
  """Makes the packages importable and gives a CPU run devices to shard.

  Until the packages are installed (setup.py), they are used from the
  checkout. Emulated CPU devices give the CPU run a mesh; the flag only
  changes the CPU platform, so it is harmless where GPUs are present, and an
  explicit setting wins. Must run before JAX starts a backend.
  """
  for package, folder in (("reference_host", "host"),
                          ("collective_matmul", "plugin")):
    if importlib.util.find_spec(package) is None:
      sys.path.insert(0, os.path.join(REPO_ROOT, folder))
  if "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8")
  # Quiet by default, as the scripts' own logs: XLA's C++ warnings (e.g.
  # SPMD's "Involuntary full rematerialization") only with --verbosity or
  # an explicit TF_CPP_MIN_LOG_LEVEL; errors always.
  if "TF_CPP_MIN_LOG_LEVEL" not in os.environ and not any(
      arg.partition("=")[0].lstrip("-") in ("verbosity", "v")
      for arg in sys.argv[1:]):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
  # XLA_FLAGS the Hopper kernels may run under (left as they are on a JAX
  # whose kernels are checked under CUDA-graph capture); both arms of the
  # A/B run with the same XLA_FLAGS.
  import collective_matmul  # pylint: disable=g-import-not-at-top
  collective_matmul.prepare_xla_for_kernels()


# absl's help flags: it prints the usage and exits with status 1.
_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpfull", "-helpfull",
               "--helpshort", "-helpshort", "--helpxml", "-helpxml")


def run_app(main):
  """`absl.app.run` of `main(argv) -> exit status`, where asking for help
  exits 0 (absl's --help exits 1, as if it were an error)."""
  from absl import app  # pylint: disable=g-import-not-at-top
  try:
    app.run(lambda argv: sys.exit(main(argv)))
  except SystemExit as e:
    if e.code == 1 and any(arg.partition("=")[0] in _HELP_FLAGS
                           for arg in sys.argv[1:]):
      sys.exit(0)
    raise
