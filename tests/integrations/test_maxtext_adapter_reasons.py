"""Which MaxText projections the adapter serves, and why it leaves the rest
to MaxText: pure decisions on stand-in modules (no MaxText import)."""
import types

import jax.numpy as jnp
import pytest

from collective_matmul.integrations.maxtext import dense as dense_lib
from collective_matmul.integrations.maxtext import frames as frames_lib
from collective_matmul.integrations.maxtext import owners
from collective_matmul.integrations.maxtext import projections

X3 = jnp.zeros((2, 8, 16))
W = jnp.zeros((16, 32))


def _stack(kernel_axes, owner="mlp", mode="train", attr="wi_0", moe=False,
           shard_mode="ShardMode.AUTO"):
  dense = types.SimpleNamespace(kernel_axes=kernel_axes,
                                shard_mode=shard_mode)
  owner_module = types.SimpleNamespace(**{attr: dense})
  frames = [frames_lib.Frame("moe", types.SimpleNamespace(
      shared_experts=owner_module))] if moe else []
  if owner:
    frames.append(frames_lib.Frame(owner, owner_module, mode))
  return frames + [frames_lib.Frame("dense", dense)]


def _reason(stack, inputs=X3, kernel=W, quant=None, scale=None, fp8=False):
  return dense_lib.not_served_reason(stack, inputs, kernel, quant, scale, fp8)


def test_a_known_training_projection_is_served_and_named():
  reason, projection, name = _reason(_stack(("embed", "mlp")))
  assert reason is None and name == "mlp/wi_0"
  assert projection.activation_axes == projections.RESIDUAL
  assert projection.collective == "all_gather"


def test_the_output_projections_are_reduce_scatters():
  for owner, axes, attr in (("mlp", ("mlp", "embed"), "wo"),
                            ("attention", ("heads", "kv", "embed_attn"),
                             "out")):
    inputs = X3 if owner == "mlp" else jnp.zeros((2, 8, 4, 4))
    reason, projection, name = _reason(_stack(axes, owner, attr=attr),
                                       inputs=inputs)
    assert reason is None and name == f"{owner}/{attr}"
    assert projection.collective == "reduce_scatter"
    assert projection.out_axes == projections.RESIDUAL


@pytest.mark.parametrize("kwargs,stack_kwargs,expected", [
    (dict(quant=object()), {}, "quantized"),
    (dict(scale=jnp.ones(())), {}, "fp8"),
    (dict(fp8=True), {}, "fp8"),
    (dict(kernel=jnp.zeros((16, 32), jnp.float8_e4m3fn)), {}, "fp8"),
    ({}, dict(shard_mode="ShardMode.EXPLICIT"), "shard_mode=explicit"),
    ({}, dict(moe=True, owner=None), "inside a mixture-of-experts block"),
    ({}, dict(owner=None), "not a projection of an MlpBlock, Attention or "
     "the decoder's output head"),
    ({}, dict(mode="prefill"), "model_mode='prefill'"),
    ({}, dict(mode="autoregressive"), "model_mode='autoregressive'"),
    (dict(inputs=jnp.zeros((8, 16))), {}, "activation of rank 2"),
])
def test_everything_else_is_left_to_maxtext_with_a_reason(kwargs, stack_kwargs,
                                                          expected):
  reason, projection, _ = _reason(_stack(("embed", "mlp"), **stack_kwargs),
                                  **kwargs)
  assert projection is None and expected in reason


def test_the_decoders_logits_projection_is_an_all_gather_matmul():
  reason, projection, name = _reason(_stack(("embed_vocab", "vocab"),
                                            owner="decoder",
                                            attr="logits_dense"))
  assert reason is None and name == "decoder/logits_dense"
  assert projection.collective == "all_gather"
  assert projection.activation_axes == projections.LOGITS_INPUT


def test_the_logits_projection_outside_training_is_left_to_maxtext():
  reason, projection, _ = _reason(_stack(("embed_vocab", "vocab"),
                                         owner="decoder", mode="prefill",
                                         attr="logits_dense"))
  assert projection is None and "model_mode='prefill'" in reason


def test_unknown_kernel_axes_are_left_to_maxtext():
  reason, projection, name = _reason(_stack(("embed", "vocab"), attr="x"))
  assert projection is None and "not a known mlp projection" in reason
  assert name == "mlp/x"


def test_every_projection_is_keyed_by_owner_and_kernel_axes_once():
  keys = [(p.owner, p.kernel_axes) for p in projections.PROJECTIONS]
  assert len(keys) == len(set(keys))
  for p in projections.PROJECTIONS:
    assert projections.find_projection(p.owner, list(p.kernel_axes)) is p


@pytest.mark.parametrize("argv,may_run", [
    (["prog", "base.yml", "steps=3"], False),
    (["prog", "base.yml", "--use_collective_matmul"], True),
    (["prog", "--use_collective_matmul", "--collective_matmul_impl=pallas"],
     True),
    (["prog", "--use_collective_matmul", "--collective_matmul_impl=ring"],
     False),
    (["prog", "--use_collective_matmul=false"], False),
    (["prog", "--use_collective_matmul", "--nouse_collective_matmul"], False),
])
def test_the_launcher_switches_command_buffers_off_only_for_kernel_runs(
    argv, may_run):
  from collective_matmul.integrations.maxtext import __main__ as launcher
  assert launcher._kernels_may_run(argv) == may_run


def test_a_quantized_layers_construction_call_is_not_recorded():
  # MaxText's quantized DenseGeneral calls itself once at construction on a
  # dummy input (`_initializing`): MaxText's path, and no decision, so the
  # record holds only what a step runs.
  import collective_matmul as cm  # pylint: disable=g-import-not-at-top
  calls = []
  dot_general_nnx = dense_lib.make_dot_general_nnx(
      lambda *args, **kwargs: calls.append(args) or "maxtext")
  cm.clear_decisions()
  stack = frames_lib.stack()
  stack[:] = _stack(("embed", "mlp"))
  try:
    with cm.config_context(cm.CollectiveMatmulConfig(enabled=True)):
      result = dot_general_nnx(X3, W, (2,), (0,), "default", object(), True)
  finally:
    stack.clear()
  assert result == "maxtext" and len(calls) == 1
  assert cm.decisions() == []


def test_a_projection_nested_in_another_owner_is_named_through_it():
  # deepseek: the shared experts' MlpBlock inside the MoE block, and the
  # dense layers' MlpBlock, have the same attributes: the names differ, and
  # both are served as MlpBlock's projections.
  nested_reason, nested_projection, nested = _reason(
      _stack(("embed", "mlp"), moe=True))
  _, dense_projection, dense_layer = _reason(_stack(("embed", "mlp")))
  assert nested == "moe/shared_experts/wi_0"
  assert dense_layer == "mlp/wi_0"
  assert nested_reason is None and nested_projection is dense_projection


@pytest.mark.parametrize("kernel_axes,attr,collective", [
    (("embed", "mlp"), "wi_0", "all_gather"),
    (("embed", "num_activations", "mlp"), "wi", "all_gather"),
    (("mlp", "embed"), "wo", "reduce_scatter"),
])
def test_the_shared_experts_in_a_moe_block_are_served_where_they_match(
    kernel_axes, attr, collective):
  # RoutedAndSharedMoE (deepseek, llama4): its shared experts are an
  # MlpBlock; weights of the dense pattern are served as any MlpBlock's.
  reason, projection, name = _reason(_stack(kernel_axes, attr=attr,
                                            moe=True))
  assert reason is None and name == f"moe/shared_experts/{attr}"
  assert projection == projections.find_projection("mlp", kernel_axes)
  assert projection.collective == collective


def test_the_shared_experts_in_a_moe_block_that_do_not_match_are_left():
  # Weights that are not the dense pattern: left, the reason saying where
  # they are and which axes do not match.
  reason, projection, name = _reason(_stack(("embed_moe", "mlp_moe"),
                                            moe=True))
  assert projection is None and name == "moe/shared_experts/wi_0"
  assert reason == (
      "the shared experts of a mixture-of-experts block (RoutedAndSharedMoE's "
      "MlpBlock): kernel axes ('embed_moe', 'mlp_moe') are not a known mlp "
      "projection")
  # Outside training too, as every MlpBlock.
  reason, projection, _ = _reason(_stack(("embed", "mlp"), moe=True,
                                         mode="inference"))
  assert projection is None and reason == (
      "model_mode='inference' (the adapter serves training)")


def test_owners_of_one_kind_nested_are_one_name_part():
  # MaxText's MoE block with shared experts holds the routed one; MLA's
  # __call__ runs Attention's.
  gate = types.SimpleNamespace()
  routed = types.SimpleNamespace(gate=gate)
  outer = types.SimpleNamespace(MoeBlock_0=routed)
  owners = [frames_lib.Frame("moe", outer), frames_lib.Frame("moe", routed)]
  assert frames_lib.projection_name(owners, gate) == "moe/gate"
  assert frames_lib.projection_name(owners, object()) is None


@pytest.mark.parametrize("kernel_axes,attr,says", [
    (("embed_attn", "q_lora_up_proj"), "wq_a", "low-rank down projection"),
    (("embed_attn", "kv_lora_up_proj"), "wkv_a", "low-rank down projection"),
    (("q_lora", "q_heads", "kv"), "wq_b", "already gathered on sequence"),
    (("kv_lora", "kv_heads", "kv_head_dim"), "wkv_b",
     "already gathered on sequence"),
])
def test_mla_projections_left_say_why_no_collective_matmul_fits(
    kernel_axes, attr, says):
  reason, projection, name = _reason(_stack(kernel_axes, owner="attention",
                                            attr=attr))
  assert projection is None and name == f"attention/{attr}"
  assert reason.startswith("multi-head latent attention's") and says in reason


def test_every_projection_left_by_name_is_not_also_served():
  for owner, kernel_axes in projections.LEFT:
    assert projections.find_projection(owner, kernel_axes) is None


def test_a_test_layers_own_matmuls_are_recorded_as_left_in_chain_order():
  import collective_matmul as cm  # pylint: disable=g-import-not-at-top

  class SimpleMlpDecoderLayer:
    ff_1 = jnp.zeros((16, 64))
    ff_2 = jnp.zeros((64, 16))

  call = owners.make_own_matmul_layer_call(lambda self, x: "maxtext",
                                             weights=("ff_1", "ff_2"))
  cm.clear_decisions()
  with cm.config_context(cm.CollectiveMatmulConfig(enabled=True)):
    assert call(SimpleMlpDecoderLayer(), (X3, None)) == "maxtext"
  records = cm.decisions()
  assert [r.name for r in records] == ["SimpleMlpDecoderLayer/ff_1",
                                       "SimpleMlpDecoderLayer/ff_2"]
  assert [(r.lhs_shape, r.rhs_shape) for r in records] == [
      ((2, 8, 16), (16, 64)), ((2, 8, 64), (64, 16))]
  assert all(not r.rewritten and "own jnp.dot" in r.reason for r in records)
  cm.clear_decisions()
  call(SimpleMlpDecoderLayer(), X3)  # Plugin off: nothing recorded.
  assert cm.decisions() == []


def test_a_decoder_layers_own_projections_are_served_and_named_by_it():
  # gemma4_small: the per-layer input gate and projection.
  for axes, attr, collective in ((("embed", "mlp"), "per_layer_input_gate",
                                  "all_gather"),
                                 (("mlp", "embed"), "per_layer_projection",
                                  "reduce_scatter")):
    reason, projection, name = _reason(_stack(axes, owner="layer",
                                              attr=attr))
    assert reason is None and name == f"layer/{attr}"
    assert projection.collective == collective


def test_a_layer_owner_is_not_part_of_nested_projections_names():
  stack = _stack(("embed", "mlp"))
  layer = types.SimpleNamespace(mlp=stack[0].module)
  stack.insert(0, frames_lib.Frame("layer", layer, "train"))
  _, projection, name = _reason(stack)
  assert name == "mlp/wi_0" and projection is not None


def test_a_dense_inside_a_layer_but_not_its_own_is_left():
  stack = _stack(("embed", "mlp"), owner="layer")
  stack[0] = frames_lib.Frame("layer", types.SimpleNamespace(), "train")
  reason, projection, _ = _reason(stack)
  assert projection is None and "not one of its own projections" in reason


@pytest.mark.parametrize("model_mode,model_call_mode,expected", [
    ("train", "", "train"),
    ("prefill", "", "prefill"),
    # RoutedAndSharedMoE builds its shared experts without a model mode.
    (None, "", "train"),
    (None, "inference", "inference"),
])
def test_an_mlp_block_without_a_model_mode_takes_maxtexts_call_mode(
    model_mode, model_call_mode, expected):
  block = types.SimpleNamespace(
      model_mode=model_mode,
      config=types.SimpleNamespace(model_call_mode=model_call_mode))
  assert owners.mlp_model_mode(block) == expected
