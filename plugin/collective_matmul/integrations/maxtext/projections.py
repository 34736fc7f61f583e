"""Which MaxText projections the plugin serves, as data (no MaxText import).

MaxText's `DenseGeneral` knows only its kernel's logical axes. The
activation's and the result's logical axes below are the ones MaxText's
training graph constrains around each projection (MaxText 0.2.5: the llama2
/ mistral decoder layers, `MlpBlock`, `Attention`, the decoder's output
head), so the plugin's layout
is the one MaxText asks for anyway and no resharding is added.
"""
from __future__ import annotations

import dataclasses

from collective_matmul.enums import Collective

# The decoder's residual stream between blocks (llama2/mistral decoder layer
# `activation_axis_names`): rows sharded over data/fsdp (batch) and
# tensor_sequence (sequence).
RESIDUAL = ("activation_batch", "activation_norm_length", "activation_embed")
# MlpBlock's intermediate activation (`intermediate_logical`).
MLP_HIDDEN = ("activation_batch", "activation_length", "activation_mlp")
# Attention's projection input (`input_axis_names`) and the attention output
# that enters the out projection (`out_axis_names`).
ATTN_INPUT = ("activation_batch_attn", "activation_input_length_attn",
              "activation_embed_attn")
ATTN_OUT = ("activation_batch_attn", "activation_length_attn",
            "activation_heads", "activation_kv")


# The decoder's output head: the final norm's output, as the residual stream
# leaves the last layer (rows sharded over tensor_sequence), and MaxText's
# logits sharding (`apply_output_head`'s out_sharding) for its batch axis.
LOGITS_INPUT = ("activation_embed_and_logits_batch", "activation_norm_length",
                "activation_embed")
# The token embedding table (`Embed.embedding`), which the output head
# contracts on its embed dimension with logits_via_embedding (tied).
EMBEDDING_AXES = ("vocab", "embed_vocab")


@dataclasses.dataclass(frozen=True)
class Projection:
  """One kind of MaxText projection.

  Attributes:
    owner: the MaxText module that holds it ("mlp" for `MlpBlock`,
      "attention" for `Attention`, "decoder" for `NNXDecoder`'s output head).
    kernel_axes: the `DenseGeneral` kernel's logical axes (its key).
    activation_axes: the input activation's logical axes.
    out_axes: the result's logical axes, for the matmul + reduce-scatter
      projections (the operands alone do not say the sum is wanted
      scattered); None for the all-gather ones.
    result_axes: an all-gather projection's result axes where MaxText's
      rules cannot resolve the ones `fp8.cotangent_axes` derives (the fp8
      gradient's matmul reads them); None: derived.
  """

  owner: str
  kernel_axes: tuple[str, ...]
  activation_axes: tuple[str, ...]
  out_axes: tuple[str, ...] | None = None
  result_axes: tuple[str, ...] | None = None

  @property
  def collective(self) -> Collective:
    return (Collective.ALL_GATHER if self.out_axes is None
            else Collective.REDUCE_SCATTER)


PROJECTIONS = tuple(Projection(*p) for p in (
    # MlpBlock: wi_0 / wi_1 (unfused), wi (fused_mlp), wo.
    ("mlp", ("embed", "mlp"), RESIDUAL, None, MLP_HIDDEN),
    ("mlp", ("embed", "num_activations", "mlp"), RESIDUAL),
    ("mlp", ("mlp", "embed"), MLP_HIDDEN, RESIDUAL),
    # Attention: query, key / value, qkv_proj (fused_qkv), out.
    ("attention", ("embed_attn", "q_heads", "kv"), ATTN_INPUT),
    ("attention", ("embed_attn", "kv_heads", "kv_head_dim"), ATTN_INPUT),
    ("attention", ("embed_attn", "heads", "kv"), ATTN_INPUT),
    ("attention", ("heads", "kv", "embed_attn"), ATTN_OUT, RESIDUAL),
    # NNXDecoder.apply_output_head: logits_dense (logits_via_embedding off),
    # and the embedding table (logits_via_embedding on).
    ("decoder", ("embed_vocab", "vocab"), LOGITS_INPUT),
    ("decoder", EMBEDDING_AXES, LOGITS_INPUT),
    # gemma4_small's decoder layer: the per-layer input gate from the
    # residual stream, and the projection of the gated per-layer input back
    # into it.
    ("layer", ("embed", "mlp"), RESIDUAL),
    ("layer", ("mlp", "embed"), MLP_HIDDEN, RESIDUAL),
    # gemma4_small's per-layer inputs (`Gemma4SmallPLE`): the projection of
    # the token embeddings, as they enter the first layer, into every
    # layer's per-layer input.
    ("per_layer_embedder", ("embed", "mlp"), RESIDUAL),
))


# Projections the adapter knows and leaves to MaxText, by (owner, kernel
# axes): why none of the collective matmuls fits them.
_MLA_DOWN = ("multi-head latent attention's low-rank down projection: its "
             "weight's output features are not sharded, so it is no "
             "all-gather matmul (MaxText gathers its small result on "
             "sequence)")
_MLA_UP = ("multi-head latent attention's up projection: its input, the "
           "low-rank latent, is already gathered on sequence (MaxText "
           "constrains it to activation_length), so there is no all-gather "
           "to overlap")
_GPT3_QKV = ("gpt3's fused query/key/value projection: its attention "
             "constrains the input to activation_length first, gathered on "
             "sequence, so there is no all-gather left to overlap")
_SHARED_EXPERT_GATE = (
    "the shared expert's gate: its kernel ('embed', None) has one output "
    "feature, unsharded: each device computes its own rows' gate, no "
    "all-gather to overlap")
_QWEN3_CUSTOM_UP = (
    "qwen3-custom's up projection after the experts: its input, the routed "
    "experts' output, is sharded on sequence over tensor_sequence "
    "(activation_norm_length), while its kernel ('mlp', 'embed') shards its "
    "contracting dimension there and not its output features: neither the "
    "all-gather nor the reduce-scatter matmul")
LEFT = {
    ("shared_moe", ("embed", None)): _SHARED_EXPERT_GATE,
    ("qwen3_custom_layer", ("mlp", "embed")): _QWEN3_CUSTOM_UP,
    ("attention", ("embed_attn", "qkv", "heads", "kv")): _GPT3_QKV,
    ("attention", ("embed_attn", "q_lora_up_proj")): _MLA_DOWN,
    ("attention", ("embed_attn", "kv_lora_up_proj")): _MLA_DOWN,
    ("attention", ("q_lora", "q_heads", "kv")): _MLA_UP,
    ("attention", ("kv_lora", "kv_heads", "kv_head_dim")): _MLA_UP,
}


# Projections whose weight MaxText's default logical_axis_rules leave
# unsharded where the collective matmul needs it sharded, by (owner, kernel
# axes): (what it is, that kernel dimension, "output" for an all-gather
# matmul's output features or "contracting" for a reduce-scatter's).
# qwen3-next (and qwen3.5): 'embed_attn''s rule comes before 'gdn_head''s and
# 'mlp''s, takes 'fsdp_transpose', which theirs also list, and Flax then
# skips their rules whole, so these weights are replicated over
# tensor_sequence (and tensor).
RULES_UNSHARDED = {
    ("linear_attention", ("embed_attn", "gdn_head")): (
        "qwen3-next's Gated DeltaNet input projection", 1, "output"),
    ("linear_attention", ("gdn_head", "embed_attn")): (
        "qwen3-next's Gated DeltaNet output projection", 0, "contracting"),
    ("attention", ("mlp", "embed_attn")): (
        "qwen3-next's gated attention out projection", 0, "contracting"),
}


def find_projection(owner: str, kernel_axes) -> Projection | None:
  """The served projection of `owner` with these kernel axes, or None."""
  kernel_axes = tuple(kernel_axes)
  return next((p for p in PROJECTIONS
               if p.owner == owner and p.kernel_axes == kernel_axes), None)
