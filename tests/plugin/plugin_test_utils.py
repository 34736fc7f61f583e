"""Shared helpers of the plugin tests."""
import difflib
import re

import jax
from jax.sharding import AxisType
import numpy as np

DN_LAST = lambda ndim: (((ndim - 1,), (0,)), ((), ()))  # x[..., k] @ w[k, n]


def mesh_1d(d, axis_type=AxisType.Explicit, name="x"):
  return jax.make_mesh((d,), (name,), devices=jax.devices()[:d],
                       axis_types=(axis_type,))


def mesh_2d(shape, axis_type=AxisType.Explicit):
  return jax.make_mesh(shape, ("data", "tensor"),
                       devices=jax.devices()[:shape[0] * shape[1]],
                       axis_types=(axis_type, axis_type))


def normal(key, shape, dtype):
  return jax.random.normal(key, shape, jax.numpy.float32).astype(dtype)


def reference(x, w):
  """float64 `x[..., k] @ w[k, n]` of the (possibly bf16) inputs."""
  return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def max_rel_error(out, ref):
  """Largest elementwise error relative to the largest reference entry.

  Stricter than a norm ratio: a single wrong entry of typical size counts
  fully, so a misplaced block can't hide among correct ones.
  """
  out = np.asarray(out, np.float64)
  assert out.shape == ref.shape, (out.shape, ref.shape)
  assert np.isfinite(out).all()
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def assert_close(out, ref, rel):
  err = max_rel_error(out, ref)
  assert err <= rel, f"max error {err:.3g} of max |ref| exceeds {rel:.3g}"


TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def put(array, mesh, spec):
  """`array` placed on `mesh` with partition spec `spec`."""
  return jax.device_put(array, jax.sharding.NamedSharding(mesh, spec))


def compiled_hlo(mesh, f, *args, **config) -> str:
  """The compiled program of `jax.jit(f)(*args)` on `mesh` with the plugin's
  configuration `config` (a fresh function object per configuration: jit's
  cache does not key on it)."""
  import collective_matmul as cm  # pylint: disable=g-import-not-at-top
  with jax.set_mesh(mesh), cm.config_context(**config):
    return jax.jit(f).lower(*args).compile().as_text()


def normalized_hlo(text: str) -> str:
  """The program without names and debug info that differ by caller only.

  Drops the module name, the FileNames/FunctionNames/FileLocations/
  StackFrames tables (source locations of the Python callers) and every
  instruction's metadata={...} (op_name and stack frame ids). Instructions,
  shapes, shardings, collectives and fusions are kept.
  """
  text = re.sub(r"^HloModule \S+,", "HloModule M,", text, flags=re.M)
  text = re.sub(r"\nFileNames\n.*?\n\n(?=%|ENTRY)", "\n", text, flags=re.S)
  return re.sub(r", metadata=\{[^}]*\}", "", text)


def hlo_diff(reference: str, other: str, names=("reference", "other")) -> str:
  """The unified diff of two compiled programs, normalized; empty if the
  same program."""
  return "\n".join(difflib.unified_diff(
      normalized_hlo(reference).splitlines(),
      normalized_hlo(other).splitlines(), *names, lineterm=""))
