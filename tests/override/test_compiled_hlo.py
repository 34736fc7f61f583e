"""What the compiled programs contain: read the optimized HLO text."""
import re

from jax import lax
from jax.sharding import PartitionSpec as P
import pytest

import collective_matmul as cm
from cm_test_utils import DN_LAST, mesh_1d, mesh_2d, normal, put
from cm_test_utils import compiled_hlo, hlo_diff, normalized_hlo

CASES = {
    "1d_rows": (lambda: mesh_1d(4), (16, 32), P("x", None), P(None, "x"),
                P(None, "x")),
    "1d_seq": (lambda: mesh_1d(8), (2, 16, 32), P(None, "x", None),
               P(None, "x"), P(None, None, "x")),
    "2x4_batch_seq": (lambda: mesh_2d((2, 4)), (4, 8, 32),
                      P("data", "tensor", None), P(None, "tensor"),
                      P("data", None, "tensor")),
}


def _inputs(case, keys):
  make_mesh, x_shape, x_spec, w_spec, out_spec = CASES[case]
  mesh = make_mesh()
  n = 8 * mesh.axis_sizes[-1]
  x = put(normal(keys(), x_shape, "float32"), mesh, x_spec)
  w = put(normal(keys(), (32, n), "float32"), mesh, w_spec)
  return mesh, x, w, out_spec


_compiled = compiled_hlo
_normalized = normalized_hlo


@pytest.mark.parametrize("case", list(CASES))
def test_ring_program_has_permutes_and_no_activation_all_gather(case, keys):
  mesh, x, w, _ = _inputs(case, keys)
  text = _compiled(mesh, lambda x, w: cm.dot_general(x, w, DN_LAST(x.ndim)),
                   x, w, enabled=True, impl="ring")
  assert [d.rewritten for d in cm.decisions()] == [True]
  assert "all-gather" not in text
  assert "collective-permute" in text


@pytest.mark.parametrize("case", list(CASES))
def test_plain_program_all_gathers_the_activation(case, keys):
  """The check above can fail: XLA's own program does have the all-gather."""
  mesh, x, w, out_spec = _inputs(case, keys)
  text = _compiled(mesh, lambda x, w: lax.dot_general(
      x, w, DN_LAST(x.ndim), out_sharding=out_spec), x, w)
  gathers = re.findall(r"= (f32\[[\d,]+\]).*? all-gather\(", text)
  assert gathers, text
  # What is gathered is the activation: its per-device shape along 'x'/'tensor'
  # grown back (k = 32 is the minor dimension).
  assert all(g.endswith(",32]") for g in gathers), gathers
  assert "collective-permute" not in text


@pytest.mark.parametrize("case", list(CASES))
def test_flag_off_compiles_to_plain_dot_general(case, keys):
  mesh, x, w, out_spec = _inputs(case, keys)
  dn = DN_LAST(x.ndim)
  plugin = lambda x, w: cm.dot_general(x, w, dn, out_sharding=out_spec)
  plain = lambda x, w: lax.dot_general(x, w, dn, out_sharding=out_spec)
  off = _compiled(mesh, plugin, x, w, enabled=False, impl="ring")
  reference = _compiled(mesh, plain, x, w)
  assert not cm.decisions()
  diff = hlo_diff(reference, off, ("lax.dot_general", "cm.dot_general (off)"))
  assert not diff, diff
  # Normalization is honest: the raw texts differ only in what it drops,
  # and a rewritten program stays different after it.
  assert "FileNames" in reference and "metadata=" in reference
  # A new function object: jit's trace cache does not key on the plugin's
  # configuration, so `plugin` itself would reuse the flag-off trace.
  on = _compiled(mesh, lambda x, w: plugin(x, w), x, w, enabled=True,
                 impl="ring")
  assert [d.rewritten for d in cm.decisions()] == [True]
  assert _normalized(on) != _normalized(reference)
  assert "dot(" in _normalized(reference) or "fusion(" in _normalized(
      reference)
