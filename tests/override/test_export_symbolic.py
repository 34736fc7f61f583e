"""jax.export with symbolic dimensions (shape polymorphism): a matmul the
plugin would rewrite is left to XLA with the reason recorded, so calling
the export does what it does with the plugin off (issue 39, item 1: the
exported ring segfaulted). Each export runs in a child process, so that a
crash fails the test instead of ending the session."""
import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# Exports `cm.dot_general` of the all-gather pattern over shapes with a
# symbolic dimension, plugin off then on, and calls each with concrete
# inputs; prints what each call did and the plugin's decisions as JSON.
_CHILD = r"""
import json, sys
import jax
from jax import export
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
import numpy as np
import collective_matmul as cm

symbolic, seed = sys.argv[1], int(sys.argv[2])
mesh = jax.make_mesh((2, 4), ("data", "tensor"), devices=jax.devices()[:8],
                     axis_types=(AxisType.Explicit,) * 2)
x_spec, w_spec = P("data", "tensor", None), P(None, "tensor")
out = NamedSharding(mesh, P("data", None, "tensor"))
dims = (((2,), (0,)), ((), ()))
if symbolic == "batch":
  b, = export.symbolic_shape("b")
  x_shape, k = (2 * b, 8, 16), 16
  concrete_x = (4, 8, 16)
else:
  k, = export.symbolic_shape("k")
  x_shape = (2, 8, k)
  concrete_x = (2, 8, 24)
rng = np.random.default_rng(seed)
xv = rng.standard_normal(concrete_x).astype(np.float32)
wv = rng.standard_normal((concrete_x[-1], 32)).astype(np.float32)
x = jax.device_put(xv, NamedSharding(mesh, x_spec))
w = jax.device_put(wv, NamedSharding(mesh, w_spec))
outcomes = {}
for enabled in (False, True):
  with jax.set_mesh(mesh), cm.config_context(enabled=enabled, impl="ring"):
    exported = export.export(jax.jit(
        lambda x, w: cm.dot_general(x, w, dims, out_sharding=out)))(
            jax.ShapeDtypeStruct(x_shape, jnp.float32,
                                 sharding=NamedSharding(mesh, x_spec)),
            jax.ShapeDtypeStruct((k, 32), jnp.float32,
                                 sharding=NamedSharding(mesh, w_spec)))
  try:
    with jax.set_mesh(mesh):
      y = np.asarray(exported.call(x, w), np.float64)
    error = float(np.abs(y - xv.astype(np.float64) @ wv).max())
    outcomes[str(enabled)] = ["ran", error]
  except Exception as e:
    outcomes[str(enabled)] = ["raised", type(e).__name__]
print(json.dumps({"outcomes": outcomes, "decisions": [
    [d.rewritten, d.reason] for d in cm.decisions()]}))
"""


@pytest.mark.parametrize("symbolic", ["batch", "contraction"])
def test_an_export_with_a_symbolic_dimension_is_left_to_xla_and_does_not_die(
    symbolic, rng):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  run = subprocess.run(
      [sys.executable, "-c", _CHILD, symbolic, str(rng.integers(1 << 30))],
      capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
  assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
  result = json.loads(run.stdout.strip().splitlines()[-1])
  off, on = result["outcomes"]["False"], result["outcomes"]["True"]
  assert on[0] == off[0]
  if on[0] == "ran":
    assert on[1] < 1e-3 and off[1] < 1e-3
  else:
    assert on[1] == off[1]  # The same error as JAX's, plugin off.
  (rewritten, reason), = result["decisions"]
  assert not rewritten
  assert "symbolic dimension" in reason
