"""The owners of MaxText's projections, patched: each call pushes its frame.

`owner_call` wraps an owner's method (MlpBlock, Attention and its
`compute_shared_kv`, the decoder's output head, MoE blocks, the models' own
layers, DenseGeneral itself) so that its projections know it
(`frames.Frame`); the arguments it reads are read by name. The rest are
owners whose matmuls are left to MaxText and recorded when they are called
(a MoE block's routed experts, the test layers' own `jnp.dot`), gemma4_small's
layers' model mode, and the tied-embedding logits (`attend_on_embedding`),
served here as a collective matmul of the embedding table.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import jax.numpy as jnp

from collective_matmul import config as config_lib
from collective_matmul import override
from collective_matmul import record
from collective_matmul.integrations.maxtext import frames
from collective_matmul.integrations.maxtext import projections

# The decoder's output head with logits_via_embedding: the token embedding
# table, [vocab, embed_vocab] (`Embed.embedding`), contracted on embed.
TIED_LOGITS = "decoder/logits_via_embedding"
# A RoutedMoE's expert weights, [experts, in, out] (`prefuse_moe_weights`:
# wi holds wi_0 and wi_1).
_EXPERT_WEIGHTS = ("wi_0", "wi_1", "wi", "wo")
# MaxText's test decoder layers (`maxtext.models.simple_layer`, decoder_block
# simple / simple_mlp): their weights, in the order jnp.dot chains them.
OWN_MATMUL_LAYERS = {"SimpleDecoderLayer": ("weights",),
                     "SimpleMlpDecoderLayer": ("ff_1", "ff_2")}

Arguments = dict[str, Any]


def owner_call(kind: str,
               mode_of: Callable[[Any, Arguments], str | None],
               details: Callable[[Arguments], dict[str, Any]] = (
                   lambda arguments: {}),
               label: str = ""):
  """A wrapper factory for an owner's method: the call runs within a
  `frames.Frame(kind, self, mode_of(self, arguments), label, **details(
  arguments))`, `arguments` the call's arguments by parameter name."""
  def make(original):
    signature = inspect.signature(original)

    def call(self, *args, **kwargs):
      try:
        arguments = signature.bind(self, *args, **kwargs).arguments
      except TypeError:  # MaxText's own call raises it.
        return original(self, *args, **kwargs)
      with frames.entered(frames.Frame(kind, self, mode_of(self, arguments),
                                       label=label, **details(arguments))):
        return original(self, *args, **kwargs)
    call.__wrapped__ = original
    return call
  return make


def model_mode_or_train(self, arguments: Arguments) -> str:
  """The call's `model_mode`, else the module's, else training."""
  return (arguments.get("model_mode") or getattr(self, "model_mode", None)
          or frames.TRAIN)


def attention_details(arguments: Arguments) -> dict[str, Any]:
  """Attention's call: self-attention when query and key/value project one
  array and no shared key/value comes in."""
  same = arguments.get("inputs_q") is arguments.get("inputs_kv")
  shared = (arguments.get("shared_key") is not None or
            arguments.get("shared_value") is not None)
  return {"self_attention": same and not shared}


def mlp_model_mode(mlp_block) -> str:
  """An MlpBlock's model mode; one built without (RoutedAndSharedMoE's
  shared experts): MaxText's model_call_mode ("inference" under vLLM), which
  qwen3-next's shared expert is built with, and "" is training."""
  return (getattr(mlp_block, "model_mode", None) or
          getattr(getattr(mlp_block, "config", None), "model_call_mode",
                  None) or frames.TRAIN)


def _routed_experts_reason(maxtext_config) -> str:
  if not getattr(maxtext_config, "sparse_matmul", True):
    how = "dense einsum over dispatched tokens"
  elif getattr(maxtext_config, "use_tokamax_gmm", False):
    how = "tokamax grouped matmul"
  elif getattr(maxtext_config, "megablox", False):
    how = "megablox grouped matmul"
  else:
    how = "jax.lax.ragged_dot"
  return (f"routed experts ({how}): expert parallelism is another "
          "collective (tokens go to their experts' devices), not a dense "
          "projection's all-gather or reduce-scatter")


def make_routed_moe_call(original):
  def call(self, inputs, *args, **kwargs):
    with frames.entered(frames.Frame("moe", self)):
      if config_lib.get_config().enabled:
        owners = [f for f in frames.stack() if f.kind != "dense"]
        reason = _routed_experts_reason(getattr(self, "config", None))
        for attr in _EXPERT_WEIGHTS:
          weight = getattr(self, attr, None)
          if weight is None:
            continue
          weight = weight.get_value() if hasattr(weight, "get_value") else (
              weight)
          record.record_not_served(
              frames.projection_name(owners, getattr(self, attr)) or f"moe/{attr}",
              f"left to MaxText: {reason}", lhs_shape=jnp.shape(inputs),
              rhs_shape=jnp.shape(weight), dtype=jnp.result_type(inputs))
      return original(self, inputs, *args, **kwargs)
  call.__wrapped__ = original
  return call


def make_decoder_mode_call(original):
  """gemma4_small's layers: their model mode, for the per-layer inputs'
  projection (`Gemma4SmallPLE` takes none)."""
  signature = inspect.signature(original)

  def call(self, *args, **kwargs):
    mode = signature.bind(self, *args, **kwargs).arguments.get("model_mode")
    previous = getattr(frames.local, "decoder_mode", None)
    frames.local.decoder_mode = mode
    try:
      return original(self, *args, **kwargs)
    finally:
      frames.local.decoder_mode = previous
  call.__wrapped__ = original
  return call


def make_own_matmul_layer_call(original, weights):
  """Records a test decoder layer's own jnp.dot matmuls as left."""
  def call(self, inputs, *args, **kwargs):
    if config_lib.get_config().enabled:
      x = inputs[0] if isinstance(inputs, tuple) else inputs
      lhs_shape = jnp.shape(x)
      for attr in weights:
        weight = getattr(self, attr)
        shape = jnp.shape(weight.get_value() if hasattr(weight, "get_value")
                          else weight)
        record.record_not_served(
            f"{type(self).__name__}/{attr}",
            "left to MaxText: a test decoder layer's own jnp.dot (no "
            "DenseGeneral, so no logical axes to serve it with)",
            lhs_shape=lhs_shape, rhs_shape=shape,
            dtype=jnp.result_type(x))
        lhs_shape = (*lhs_shape[:-1], shape[-1])
    return original(self, inputs, *args, **kwargs)
  call.__wrapped__ = original
  return call


def make_attend_on_embedding(original):
  """The decoder's tied-embedding logits: `jnp.dot(query, bf16(table).T,
  preferred_element_type=attend_dtype)` as a collective matmul of the
  table [vocab, embed_vocab] contracted on its second dimension."""
  def attend_on_embedding(query, embedding_table, attend_dtype, config,
                          out_sharding=None):
    def maxtext_path():
      return original(query, embedding_table, attend_dtype, config,
                      out_sharding)

    stack = frames.stack()
    if (not config_lib.get_config().enabled or not stack or
        stack[-1].kind != "decoder"):
      return maxtext_path()
    table_shape = jnp.shape(embedding_table)
    reason = None
    qwix = frames.qwix_mode(stack)
    if qwix is not None:
      reason = "quantized: " + (qwix.left_reason or (
          f"Qwix {qwix.quantization} on the tied-embedding logits (its fp8 "
          "is served on DenseGeneral projections only)"))
    elif "EXPLICIT" in str(getattr(config, "shard_mode", "")).upper():
      reason = ("shard_mode=explicit (the adapter serves MaxText's logical, "
                "Auto-sharded route)")
    elif stack[-1].model_mode != frames.TRAIN:
      reason = (f"model_mode={stack[-1].model_mode!r} (the adapter serves "
                "training)")
    elif jnp.ndim(query) != len(projections.LOGITS_INPUT):
      reason = (f"activation of rank {jnp.ndim(query)}, expected "
                f"{projections.LOGITS_INPUT}")
    elif getattr(config, "parameter_memory_host_offload", False):
      reason = "the embedding table is offloaded to host memory"
    if reason is not None:
      record.record_not_served(
          TIED_LOGITS, f"left to MaxText: {reason}",
          lhs_shape=jnp.shape(query), rhs_shape=table_shape,
          dtype=qwix.dtype if qwix else jnp.result_type(query))
      return maxtext_path()
    projection = projections.find_projection("decoder",
                                             projections.EMBEDDING_AXES)
    # As jnp.dot: the table in bf16, both operands promoted to one dtype.
    table = jnp.asarray(embedding_table, jnp.bfloat16)
    dtype = jnp.promote_types(jnp.result_type(query), table.dtype)
    return override.collective_dot_general(
        jnp.asarray(query, dtype), jnp.asarray(table, dtype),
        (((jnp.ndim(query) - 1,), (1,)), ((), ())), None,
        preferred_element_type=attend_dtype,
        lhs_axes=projection.activation_axes,
        rhs_axes=projection.kernel_axes, name=TIED_LOGITS)

  attend_on_embedding.__wrapped__ = original
  return attend_on_embedding
