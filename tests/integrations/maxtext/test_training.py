"""Real MaxText trained through the plugin's launcher, against stock MaxText.

Every run is a subprocess on 8 emulated CPU devices (MaxText owns its
process: absl flags, JAX config), about 20 s each; runs shared by several
tests are made once per session.
"""
import os
import re
import shutil

import numpy as np
import pytest

from maxtext_runs import WORK, cached_train_together

RING = ("--use_collective_matmul", "--collective_matmul_impl=ring")
LOSS_RTOL = {"f32": 1e-5, "bf16": 2e-3}
STEPS = 4

MLP = ("mlp/wi_0", "mlp/wi_1", "mlp/wo")
ATTENTION = ("attention/query", "attention/key", "attention/value",
             "attention/out")


def spec(name, **kwargs):
  """(name, kwargs) of a run, `STEPS` steps unless given."""
  return name, dict(kwargs, steps=kwargs.get("steps", STEPS))


def together(*specs):
  """The runs of `specs` (see `spec`), those not made yet at once."""
  return cached_train_together(*specs)


def run(name, **kwargs):
  return together(spec(name, **kwargs))[0]


def _spec(kind, plugin, model, mesh, dtype, **kw):
  return spec(f"{model}-{mesh}-{dtype}-{kind}", model=model, mesh=mesh,
              dtype=dtype, plugin=plugin, **kw)


def stock(model, mesh, dtype="bf16", **kw):
  return together(_spec("stock", None, model, mesh, dtype, **kw))[0]


def off(model, mesh, dtype="bf16", **kw):
  return together(_spec("off", (), model, mesh, dtype, **kw))[0]


def ring(model, mesh, dtype="bf16", **kw):
  return together(_spec("ring", RING, model, mesh, dtype, **kw))[0]


def ring_and_off(model, mesh, dtype="bf16", **kw):
  """`ring(...)` and `off(...)`, run at once where neither is made yet."""
  return together(_spec("ring", RING, model, mesh, dtype, **kw),
                  _spec("off", (), model, mesh, dtype, **kw))


def assert_losses_close(a, b, rtol):
  assert sorted(a.losses) == sorted(b.losses) == list(range(STEPS))
  for step in a.losses:
    assert np.isfinite(a.losses[step])
    assert abs(a.losses[step] - b.losses[step]) <= rtol * abs(
        b.losses[step]), (step, a.losses, b.losses)


def assert_rewritten(run_, names, *, gathered=None):
  lines = run_.decision_lines()
  for name in names:
    hits = [l for l in lines if l.startswith(name + " ")]
    assert hits, f"{name} not in the decision record:\n{run_.stdout}"
    for line in hits:
      assert "rewritten -> ring over 'tensor_sequence'" in line, line
      reduce_scatter = name.endswith(("/wo", "/out"))
      assert ("(matmul + reduce-scatter)" in line) == reduce_scatter, line
      if gathered is not None:
        assert (f"weight gathered over {gathered}" in line), line


# -------------------------------------------------------------- plugin off


def test_plugin_off_is_bit_identical_to_stock_maxtext():
  a, b = stock("llama2-7b", "ts4_data2"), off("llama2-7b", "ts4_data2")
  assert a.losses == b.losses
  ca, cb = a.checkpoint(STEPS - 1), b.checkpoint(STEPS - 1)
  assert ca.keys() == cb.keys()
  for key in ca:
    np.testing.assert_array_equal(ca[key], cb[key], err_msg=key)
  assert "rewritten" not in b.stdout.replace("plugin off", "")


def test_a_mesh_without_the_pattern_rewrites_nothing_and_is_bit_identical():
  # Plain tensor parallelism: the activation is sharded on its features,
  # there is no all-gather to overlap.
  a = stock("llama2-7b", "tensor4_data2")
  b = run("llama2-7b-tensor4_data2-bf16-ring", mesh="tensor4_data2",
          plugin=RING)
  assert a.losses == b.losses
  assert "collective matmul: 0 of " in b.stdout
  assert not any(" rewritten -> " in l for l in b.decision_lines())


def test_plain_tensor_parallelism_gives_the_reasons_readme_quotes_and_the_hint():
  # The same run as above (cached): MaxText's record says what README
  # quotes, and the launcher says to use tensor-sequence parallelism.
  b = run("llama2-7b-tensor4_data2-bf16-ring", mesh="tensor4_data2",
          plugin=RING)
  import readme_commands  # pylint: disable=g-import-not-at-top
  paragraph = re.search(r"Plain tensor parallelism.*?\n\n",
                        readme_commands.readme(), re.S).group(0)
  quoted = re.findall(r'"([^"]+)"', " ".join(paragraph.split()))
  assert quoted
  lines = b.decision_lines()
  for quote in quoted:
    assert any(quote in line for line in lines), (quote, lines)
  assert "set ici_tensor_sequence_parallelism > 1" in b.stdout
  summary = b.stdout[b.stdout.index("collective matmul summary"):]
  assert "rewritten: 0 of " in summary


# ------------------------------------------------------ plugin on: numerics


@pytest.mark.parametrize("model,mesh", [("llama2-7b", "ts4_data2"),
                                        ("llama3-8b", "ts2_data2_fsdp2")])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_ring_trains_to_the_same_losses_as_plugin_off(model, mesh, dtype):
  assert_losses_close(*ring_and_off(model, mesh, dtype), LOSS_RTOL[dtype])


def test_every_projection_is_rewritten_on_a_tensor_sequence_mesh():
  assert_rewritten(ring("llama2-7b", "ts4_data2"), MLP + ATTENTION,
                   gathered=None)


def test_fsdp_weights_are_gathered_and_every_projection_rewritten():
  assert_rewritten(ring("llama3-8b", "ts2_data2_fsdp2"), MLP + ATTENTION,
                   gathered=("fsdp",))


def test_fused_projections_are_rewritten_with_the_same_losses():
  fused = ("fused_mlp=True", "fused_qkv=True")
  a, b = together(spec("llama2-7b-fused-ring", plugin=RING, extra=fused),
                  spec("llama2-7b-fused-off", plugin=(), extra=fused))
  assert_losses_close(a, b, LOSS_RTOL["bf16"])
  assert_rewritten(a, ("mlp/wi", "mlp/wo", "attention/qkv_proj",
                       "attention/out"))


def test_the_logits_projection_is_rewritten():
  assert_rewritten(ring("llama2-7b", "ts4_data2"), ("decoder/logits_dense",))


# ------------------------------------------------------------ checkpoints


def test_parameter_tree_is_the_same_with_the_plugin_on():
  a = ring("llama2-7b", "ts4_data2").checkpoint(STEPS - 1)
  b = off("llama2-7b", "ts4_data2").checkpoint(STEPS - 1)
  assert {k: (v.shape, v.dtype) for k, v in a.items()} == {
      k: (v.shape, v.dtype) for k, v in b.items()}


def test_initial_parameters_are_identical_with_the_plugin_on():
  # MaxText's first checkpoint is written after step 0's update; with a
  # learning rate of 0 it holds the initial parameters.
  frozen = ("learning_rate=0",)
  a, b = together(
      spec("llama2-7b-lr0-ring", plugin=RING, steps=1, extra=frozen),
      spec("llama2-7b-lr0-off", plugin=(), steps=1, extra=frozen))
  ca, cb = a.checkpoint(0), b.checkpoint(0)
  params = [k for k in ca if k.startswith("['params']")]
  assert params and ca.keys() == cb.keys()
  for key in params:
    np.testing.assert_array_equal(ca[key], cb[key], err_msg=key)


def _resume(name, source, plugin):
  """A run that restores `source`'s step-2 checkpoint and trains on."""
  target = os.path.join(WORK, name, "checkpoints", "2")
  if not os.path.isdir(target):
    shutil.copytree(os.path.join(source.checkpoint_dir, "2"), target)
  return run(name, plugin=plugin)


@pytest.mark.parametrize("first,then", [("ring", "off"), ("off", "ring")])
def test_a_checkpoint_restores_with_the_flag_flipped(first, then):
  runs = {"ring": ring("llama2-7b", "ts4_data2"),
          "off": off("llama2-7b", "ts4_data2")}
  resumed = _resume(f"resume-{first}-then-{then}", runs[first],
                    RING if then == "ring" else ())
  assert sorted(resumed.losses) == [3], resumed.losses  # Restored step 2.
  assert abs(resumed.losses[3] - runs[first].losses[3]) <= (
      LOSS_RTOL["bf16"] * runs[first].losses[3])


# ------------------------------------------------------ sibling projections


def _line(run_, name):
  hits = [l for l in run_.decision_lines() if l.startswith(name + " ")]
  # One line: a sibling served by its group records no second decision.
  assert len(hits) == 1, f"{name} in the decision record:\n{run_.stdout}"
  return hits[0]


@pytest.mark.parametrize("model,mesh", [("llama2-7b", "ts4_data2"),
                                        ("llama3-8b", "ts2_data2_fsdp2")])
def test_siblings_run_grouped_with_the_stock_losses(model, mesh):
  a = ring(model, mesh)
  assert "grouped with key, value" in _line(a, "attention/query")
  assert "grouped with query, key" in _line(a, "attention/value")
  assert "grouped with wi_1" in _line(a, "mlp/wi_0")
  assert "grouped" not in _line(a, "mlp/wo")
  assert_losses_close(a, stock(model, mesh), LOSS_RTOL["bf16"])


def test_siblings_switched_off_run_alone_with_the_same_losses():
  a = run("llama2-7b-ts4_data2-bf16-ring-ungrouped",
          plugin=RING + ("--nocollective_matmul_group_siblings",))
  for name in ("attention/query", "attention/key", "mlp/wi_1"):
    line = _line(a, name)
    assert "grouped with" not in line, line
    assert "not grouped: grouping is switched off" in line, line
  assert_losses_close(a, stock("llama2-7b", "ts4_data2"), LOSS_RTOL["bf16"])
