"""The plugin's install_requires is what it imports: `import
collective_matmul` and the drop-in on CPU need only jax, numpy and absl-py
(and what those require), not the reference host's Flax, Orbax, PyYAML or
tensorboardX, which the `host` extra brings."""
import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap

import collective_matmul

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
PLUGIN_DIR = os.path.dirname(os.path.dirname(collective_matmul.__file__))
# The reference host's packages: the check below must make them unavailable.
HOST_MODULES = ("flax", "orbax", "yaml", "tensorboardX")

# Imports the plugin with the given top-level modules unimportable, runs the
# drop-in (an all-gather matmul over 4 CPU devices, the ring) on random
# float32 operands, and prints whether the matmul was rewritten and its
# relative error against a float64 product.
_DROP_IN = textwrap.dedent("""
    import importlib.abc, json, os, sys
    blocked, seed = sys.argv[2].split(","), int(sys.argv[3])

    class Unavailable(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
          raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

    sys.meta_path.insert(0, Unavailable())
    sys.path.insert(0, sys.argv[1])
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P
    import collective_matmul as cm

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    mesh = jax.make_mesh((4,), ("x",),
                         axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh), cm.config_context(enabled=True, impl="ring"):
      xs = jax.sharding.reshard(x, P("x", None))
      ws = jax.sharding.reshard(w, P(None, "x"))
      y = jax.jit(lambda a, b: cm.dot_general(
          a, b, (((1,), (0,)), ((), ()))))(xs, ws)
    want = x.astype(np.float64) @ w.astype(np.float64)
    error = float(np.linalg.norm(np.asarray(y, np.float64) - want)
                  / np.linalg.norm(want))
    print(json.dumps({
        "rewritten": [d.rewritten for d in cm.decisions()],
        "error": error}))
""")


def _setup_keyword(name):
  """setup.py's `name` argument, evaluated from its syntax tree with the
  module's constant lists (setuptools is not needed)."""
  with open(os.path.join(REPO_ROOT, "setup.py")) as f:
    tree = ast.parse(f.read())
  constants = {}
  for node in tree.body:
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
      constants[node.targets[0].id] = eval(  # pylint: disable=eval-used
          compile(ast.Expression(node.value), "setup.py", "eval"),
          dict(constants))
  for node in ast.walk(tree):
    if isinstance(node, ast.keyword) and node.arg == name:
      value = compile(ast.Expression(node.value), "setup.py", "eval")
      return eval(value, dict(constants))  # pylint: disable=eval-used
  raise AssertionError(f"setup.py has no {name}")


def _name(requirement: str) -> str:
  """A requirement's distribution name, normalised (PEP 503)."""
  name = re.match(r"\s*([A-Za-z0-9_.-]+)", requirement).group(1)
  return re.sub(r"[-_.]+", "-", name).lower()


def _required_closure(requirements) -> set[str]:
  """The installed distributions `requirements` pull in, transitively
  (without their extras)."""
  seen, todo = set(), [_name(r) for r in requirements]
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    try:
      requires = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
      continue
    todo += [_name(r) for r in requires if "extra ==" not in r]
  return seen


def test_install_requires_names_no_host_package():
  required = {_name(r) for r in _setup_keyword("install_requires")}
  assert required == {"jax", "numpy", "absl-py"}


def test_the_host_and_test_extras_bring_the_hosts_packages():
  extras = _setup_keyword("extras_require")
  host = {_name(r) for r in extras["host"]}
  assert host >= {"flax", "orbax-checkpoint", "pyyaml", "tensorboardx"}
  assert host <= {_name(r) for r in extras["test"]}


def _modules_outside(allowed: set[str]) -> list[str]:
  """The installed top-level modules of distributions not in `allowed`."""
  return sorted(
      module for module, dists in
      importlib.metadata.packages_distributions().items()
      if module.isidentifier() and module != "collective_matmul"
      and not {_name(d) for d in dists} & allowed)


def test_the_drop_in_runs_on_its_install_requires_alone(rng):
  """Every installed package outside install_requires and what it requires
  is unimportable (optional imports of JAX's included) while the plugin is
  imported and runs."""
  blocked = _modules_outside(
      _required_closure(_setup_keyword("install_requires")))
  assert set(HOST_MODULES) <= set(blocked)
  run = subprocess.run(
      [sys.executable, "-c", _DROP_IN, PLUGIN_DIR, ",".join(blocked),
       str(int(rng.integers(2**31)))],
      capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
  assert run.returncode == 0, run.stderr[-3000:]
  result = json.loads(run.stdout.strip().splitlines()[-1])
  assert result["rewritten"] == [True]
  assert result["error"] < 1e-5
