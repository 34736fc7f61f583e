"""The package's import graph: layers that each import only those below them
(docs/ADVANCED.md's layout table), no cycle, and no Pallas on `import collective_matmul`.
"""
import ast
import os
import subprocess
import sys

import collective_matmul

PACKAGE_DIR = os.path.dirname(collective_matmul.__file__)

# Lowest first. A module imports only modules of strictly lower layers, at
# module level or inside a function ("" is the package's __init__).
LAYERS = [
    {"enums"},
    {"kernels.configs", "kernels.diagnostics"},
    {"kernels.schedule"},
    {"kernels.pipeline", "kernels.tracing", "kernels.peers"},
    {"kernels.ring_skeleton"},
    {"kernels.all_gather_matmul_kernel", "kernels.matmul_reduce_scatter_kernel"},
    {"kernels"},
    {"selection.problem"},
    {"selection.device", "selection.tuned", "ring", "patterns", "config"},
    {"selection.applicability", "plan"},
    {"selection.heuristics"},
    {"selection.decide"},
    {"selection"},
    {"dispatch", "record", "xla_flags", "shardings"},
    {"primitives"},
    {"ops", "flags"},
    {"autotuning", "override"},
    {"einsum_override", "grouping", "fp8"},
    {"qwix_fp8"},
    {"integrations", "integrations.maxtext.projections",
     "integrations.maxtext.attention", "integrations.maxtext.summary",
     "integrations.maxtext.config_errors",
     "integrations.maxtext.quantization"},
    {"integrations.maxtext.frames"},
    {"integrations.maxtext.siblings"},
    {"integrations.maxtext.dense", "integrations.maxtext.owners"},
    {"integrations.maxtext.adapter"},
    {"integrations.maxtext"},
    {""},
    {"integrations.maxtext.__main__"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules():
  """{dotted name within the package: path} of every module file."""
  found = {}
  for root, _, files in os.walk(PACKAGE_DIR):
    for file in files:
      if not file.endswith(".py"):
        continue
      rel = os.path.relpath(os.path.join(root, file), PACKAGE_DIR)[:-3]
      parts = rel.split(os.sep)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      found[".".join(parts)] = os.path.join(root, file)
  return found


MODULES = _modules()


def _imports(path):
  """The package modules `path` imports, anywhere in its code."""
  targets = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      names = [f"{node.module}.{alias.name}" for alias in node.names]
      names = [n if n.split(".", 1)[-1] in MODULES else node.module
               for n in names]
    else:
      continue
    for name in names:
      if name == "collective_matmul":
        targets.add("")
      elif name.startswith("collective_matmul."):
        targets.add(name[len("collective_matmul."):])
  return targets


def test_every_module_has_a_layer():
  assert not set(MODULES) - set(LAYER), (
      "add the new modules to LAYERS (and docs/ADVANCED.md's layout table)")


def test_every_import_points_to_a_lower_layer():
  upward = []
  for name, path in sorted(MODULES.items()):
    for target in sorted(_imports(path)):
      if LAYER.get(target, -1) >= LAYER[name]:
        upward.append(f"{name or 'collective_matmul'} imports "
                      f"{target or 'collective_matmul'}")
  assert not upward


def test_kernels_import_nothing_of_the_package_but_its_vocabulary():
  """Outside `kernels/`, only `enums` (a leaf module: the closed
  vocabularies, e.g. the configs' `MatmulDimension`)."""
  for name, path in MODULES.items():
    if name == "kernels" or name.startswith("kernels."):
      outside = {t for t in _imports(path)
                 if t not in ("kernels", "enums")
                 and not t.startswith("kernels.")}
      assert not outside, (name, outside)


def test_selection_reads_only_the_pure_kernel_modules():
  kernel_imports = {t for t in _imports(MODULES["selection"])
                    if t == "kernels" or t.startswith("kernels.")}
  assert kernel_imports <= {"kernels.configs", "kernels.schedule"}


def test_import_collective_matmul_imports_no_pallas_and_no_kernel():
  code = ("import sys, collective_matmul\n"
          "print('\\n'.join(sorted(sys.modules)))\n")
  loaded = subprocess.run([sys.executable, "-c", code], check=True,
                          capture_output=True, text=True).stdout.split()
  assert not [m for m in loaded if m.startswith((
      "jax.experimental.pallas", "jax._src.pallas.mosaic_gpu",
      "jax.experimental.mosaic.gpu"))]
  assert "collective_matmul.kernels.all_gather_matmul_kernel" not in loaded
  assert "collective_matmul.kernels.matmul_reduce_scatter_kernel" not in loaded
  assert "collective_matmul.selection" in loaded
