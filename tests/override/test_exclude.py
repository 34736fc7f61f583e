"""`exclude` (--collective_matmul_exclude): named call sites left to XLA."""
from absl import flags
import flax.linen as nn
import jax
from jax.sharding import AxisType
import numpy as np
import pytest

import collective_matmul as cm
from cm_test_utils import TOLERANCE, assert_close, mesh_2d, normal

RULES = (("batch", "data"), ("length", "tensor"), ("mlp", "tensor"))
LHS_AXES = ("batch", "length", "embed")
DN = (((2,), (0,)), ((), ()))


def _project(x, w, name):
  return cm.logical_dot_general(LHS_AXES, ("embed", "mlp"), name=name)(
      x, w, DN)


def _run(f, *args, **config):
  cm.clear_decisions()
  with jax.set_mesh(mesh_2d((2, 4), AxisType.Auto)), nn.logical_axis_rules(
      RULES):
    with cm.config_context(enabled=True, impl="ring", **config):
      out = jax.jit(f)(*args)
  return out, cm.decisions()


@pytest.mark.parametrize("exclude,left", [
    ((), set()),  # Positive control: both are rewritten.
    (("decoder/logits_dense",), {"decoder/logits_dense"}),
    (("*logits*",), {"decoder/logits_dense"}),
    (("layers_0/*", "*logits*"), {"decoder/logits_dense", "layers_0/wi"}),
    (("logits",), set()),  # A pattern matches the whole name.
])
def test_excluded_names_are_left_to_xla_with_the_same_numbers(keys, exclude,
                                                              left):
  x = normal(keys(), (4, 16, 32), "float32")
  w1 = normal(keys(), (32, 48), "float32")
  w2 = normal(keys(), (32, 64), "float32")

  def f(x, w1, w2):
    return (_project(x, w1, "layers_0/wi"),
            _project(x, w2, "decoder/logits_dense"))

  outs, decisions = _run(f, x, w1, w2, exclude=exclude)
  by_name = {d.name: d for d in decisions}
  assert {n for n, d in by_name.items() if not d.rewritten} == left
  for name in left:
    assert "excluded by the configuration" in by_name[name].reason
  for out, w in zip(outs, (w1, w2)):
    ref = np.tensordot(np.asarray(x, np.float64), np.asarray(w, np.float64),
                       axes=(2, 0))
    assert_close(out, ref, TOLERANCE["float32"])


def test_an_excluded_sibling_leaves_the_group(keys):
  x = normal(keys(), (4, 16, 32), "float32")
  kernels = [normal(keys(), (32, 48), "float32") for _ in range(2)]

  def f(x, w0, w1):
    return cm.grouped_logical_dot_general(
        x, [(w0, ("embed", "mlp"), "mlp/wi_0"),
            (w1, ("embed", "mlp"), "mlp/wi_1")], DN, lhs_axes=LHS_AXES)

  _, decisions = _run(f, x, *kernels, exclude=("*wi_1",))
  by_name = {d.name: d for d in decisions}
  assert by_name["mlp/wi_0"].rewritten and not by_name["mlp/wi_0"].group
  assert not by_name["mlp/wi_1"].rewritten


def test_the_exclude_flag_sets_the_config():
  flags.FLAGS.unparse_flags()
  try:
    flags.FLAGS(["prog", "--use_collective_matmul",
                 "--collective_matmul_exclude=*logits*,layers_0/query"])
    assert cm.config_from_flags().exclude == ("*logits*", "layers_0/query")
  finally:
    flags.FLAGS.unparse_flags()
  assert cm.CollectiveMatmulConfig().exclude == ()
  with pytest.raises(TypeError, match="not one string"):
    cm.CollectiveMatmulConfig(exclude="*logits*")
  for bad in (None, ""):
    with pytest.raises(TypeError, match="must be a non-empty name"):
      cm.CollectiveMatmulConfig(exclude=("*logits*", bad))
