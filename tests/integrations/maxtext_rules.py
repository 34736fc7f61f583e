"""MaxText 0.2.5's mesh axes and dense-layer logical axis rules, as data.

Copied from `maxtext/configs/base.yml` (the rules the dense projections,
attention and MLP use), so the plugin's handling of MaxText's rule table is
tested without importing MaxText. Each logical name maps to several mesh
axes, most of size 1 on any one mesh.
"""
MESH_AXES = ("diloco", "data", "stage", "fsdp", "fsdp_transpose", "context",
             "context_usp_ulysses", "context_autoregressive", "tensor",
             "tensor_sequence", "expert", "autoregressive")

LOGICAL_AXIS_RULES = (
    ("activation_batch_attn", ("data", "fsdp", "fsdp_transpose", "expert")),
    ("activation_input_length_attn", ("tensor_sequence", "context")),
    ("activation_heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("activation_kv_heads", ("tensor", "tensor_sequence")),
    ("activation_length_attn", ("context", "context_usp_ulysses")),
    ("activation_embed_attn", ("tensor",)),
    ("activation_kv", ("tensor", "tensor_sequence")),
    ("activation_kv_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    ("activation_kv_head_dim", ("tensor", "tensor_sequence")),
    ("heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("q_heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("kv_heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("qkv", ()),
    ("kv", ()),
    ("kv_head_dim", ()),
    ("embed_attn", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses",
                    "expert")),
    ("activation_mlp", ("tensor", "tensor_sequence")),
    ("activation_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    ("activation_length", ("context", "context_usp_ulysses")),
    ("activation_norm_length", ("tensor_sequence", "context",
                                "context_usp_ulysses")),
    ("activation_embed", ("tensor",)),
    ("mlp", ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")),
    ("embed", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses",
               "expert")),
    ("embed", ("fsdp", "context", "context_usp_ulysses", "expert")),
    ("num_activations", ()),
    ("norm", ("tensor",)),
)

# The activation axes the adapter uses for each projection (one place).
from collective_matmul.integrations.maxtext.projections import (  # pylint: disable=g-import-not-at-top,unused-import
    ATTN_INPUT, ATTN_OUT, MLP_HIDDEN, RESIDUAL)


def mesh_shape(**sizes):
  """The 12 MaxText mesh-axis sizes: 1 unless given."""
  unknown = set(sizes) - set(MESH_AXES)
  assert not unknown, unknown
  return tuple(sizes.get(name, 1) for name in MESH_AXES)
