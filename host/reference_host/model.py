"""A LLaMA-style decoder in flax.linen with MaxText's names and logical axes.

Every dense layer takes the plugin's `logical_dot_general`, told the logical
axes of its activation and kernel; the unfused projections of one activation
(query/key/value, wi_0/wi_1) go together through `grouped_logical_dot_general`.
With the plugin disabled both are `lax.dot_general` per layer, so the
parameters and the numbers do not depend on the flag.

Shapes: B batch, S sequence, E embed, H query heads, K kv heads, D head_dim,
M mlp, V vocab.
"""
from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
from flax.linen import dtypes as flax_dtypes
import jax
import jax.numpy as jnp
from jax import lax

import collective_matmul as cm

from reference_host import config as config_lib

# Activations between blocks (and entering every projection): batch over
# 'data', sequence over 'tensor' (sequence parallelism), embed replicated.
BLOCK_ACTIVATION_AXES = ("activation_batch", "activation_length",
                         "activation_embed")
MLP_ACTIVATION_AXES = ("activation_batch", "activation_length",
                       "activation_mlp")
ATTENTION_AXES = ("activation_batch", "activation_length", "activation_heads",
                  "activation_kv")
# Attention output with heads and head_dim fused, entering the out projection.
ATTENTION_OUTPUT_AXES = ("activation_batch", "activation_length",
                         "activation_heads")


_PRECISION = {"default": lax.Precision.DEFAULT, "high": lax.Precision.HIGH,
              "highest": lax.Precision.HIGHEST}


def _dtype(name: str) -> Any:
  return jnp.dtype(name)


def _layer_name(module: nn.Module, child: str) -> str:
  """'decoder/layers_0/mlp/wi_0': the parameter path, used as the layer's
  label in the plugin's decision record."""
  return "/".join((*module.scope.path, child))


def _output_projection_axes(cfg: config_lib.Config
                            ) -> tuple[str, ...] | None:
  """The logical axes the output projections (attention `out`, MLP `wo`) are
  told their result has, so the plugin can run them as matmul +
  reduce-scatter onto the sequence-sharded block activations; None (the
  plugin decides from the operands alone) with
  `collective_output_projections: False`."""
  return BLOCK_ACTIVATION_AXES if cfg.collective_output_projections else None


def _kernel_init(kernel_axes: Sequence[str]):
  """Fan-in truncated normal over the kernel's first (contracting) dim, the
  rest being output features, logically partitioned as `kernel_axes`. For a
  2-D kernel this is `nn.Dense`'s variance scaling exactly."""
  return nn.with_logical_partitioning(
      nn.initializers.variance_scaling(
          1.0, "fan_in", "truncated_normal", in_axis=0,
          out_axis=tuple(range(1, len(kernel_axes)))),
      tuple(kernel_axes))


def _plugin_dot_general(parent: nn.Module, name: str,
                        lhs_axes: Sequence[str], kernel_axes: Sequence[str],
                        out_axes: Sequence[str] | None = None):
  """The plugin's dot_general for layer `name` of `parent`, told the axes of
  both operands and, when given, of the result."""
  return cm.logical_dot_general(
      tuple(lhs_axes), tuple(kernel_axes),
      out_axes=None if out_axes is None else tuple(out_axes),
      name=_layer_name(parent, name))


def _projection(parent: nn.Module, name: str, features: int,
                lhs_axes: tuple[str, ...], kernel_axes: tuple[str, ...],
                out_axes: tuple[str, ...] | None = None) -> nn.Dense:
  """A bias-free dense layer of `parent` whose kernel carries `kernel_axes`
  and whose matmul goes through the plugin, told both operands' axes (and
  the result's, `out_axes`, where the plugin takes them)."""
  cfg = parent.config
  return nn.Dense(
      features=features, use_bias=False,
      dtype=_dtype(cfg.dtype), param_dtype=_dtype(cfg.weight_dtype),
      precision=_PRECISION[cfg.matmul_precision],
      kernel_init=_kernel_init(kernel_axes),
      dot_general=_plugin_dot_general(parent, name, lhs_axes, kernel_axes,
                                      out_axes),
      name=name)


class ProjectionKernel(nn.Module):
  """The kernel [in_features, features] of a bias-free projection, created
  as `nn.Dense` creates its own (same name, shape, dtype, initialiser and so
  the same initial values), for projections that run together
  (`sibling_projections`)."""
  config: config_lib.Config
  features: int
  kernel_axes: tuple[str, ...]

  @nn.compact
  def __call__(self, in_features: int) -> jax.Array:
    return self.param("kernel", _kernel_init(self.kernel_axes),
                      (in_features, self.features),
                      _dtype(self.config.weight_dtype))


def sibling_projections(parent: nn.Module, x: jax.Array,
                        layers: Sequence[tuple[str, int, tuple[str, ...]]]
                        ) -> list[jax.Array]:
  """Bias-free dense layers of `parent` on the same input, `(name, features,
  kernel_axes)` each, as `_projection` computes them one by one, through the
  plugin's grouped entry point: when all of them are rewritten the same way,
  one collective matmul sends `x` once for all of them (with the plugin off,
  each is its own `lax.dot_general`, as in `nn.Dense`)."""
  cfg = parent.config
  kernels = [ProjectionKernel(cfg, features, kernel_axes, name=name)(
      x.shape[-1]) for name, features, kernel_axes in layers]
  x, *kernels = flax_dtypes.promote_dtype(x, *kernels,
                                          dtype=_dtype(cfg.dtype))
  return cm.grouped_logical_dot_general(
      x, [(kernel, kernel_axes, _layer_name(parent, name))
          for kernel, (name, _, kernel_axes) in zip(kernels, layers)],
      (((x.ndim - 1,), (0,)), ((), ())),
      precision=_PRECISION[cfg.matmul_precision],
      lhs_axes=BLOCK_ACTIVATION_AXES)


class FusedProjection(nn.Module):
  """A bias-free projection of the last input dim onto several output dims,
  kernel [E, *features] (MaxText's `DenseGeneral` with a tuple of features,
  for its fused layers), in ONE `dot_general` through the plugin.

  The kernel is created in its final shape (not reshaped from 2-D as
  `nn.DenseGeneral` does, which a logically partitioned initialiser does not
  survive under a mesh). Exactly one of `kernel_axes[1:]` may map to a mesh
  axis: the plugin flattens the kernel's output dims and needs the others
  unsharded.
  """
  config: config_lib.Config
  features: tuple[int, ...]
  lhs_axes: tuple[str, ...]
  kernel_axes: tuple[str, ...]

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    if len(self.kernel_axes) != 1 + len(self.features):
      raise ValueError(f"kernel_axes {self.kernel_axes} do not match the "
                       f"kernel [{x.shape[-1]}, *{self.features}]")
    kernel = self.param("kernel", _kernel_init(self.kernel_axes),
                        (x.shape[-1], *self.features),
                        _dtype(cfg.weight_dtype))
    x, kernel = flax_dtypes.promote_dtype(x, kernel, dtype=_dtype(cfg.dtype))
    # The layer's own path already ends in its name.
    dot_general = cm.logical_dot_general(
        self.lhs_axes, self.kernel_axes, name="/".join(self.scope.path))
    return dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                       precision=_PRECISION[cfg.matmul_precision])


class RMSNorm(nn.Module):
  """Root-mean-square layer norm with a learned scale ('norm' axis)."""
  epsilon: float
  dtype: Any
  weight_dtype: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param(
        "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
        (x.shape[-1],), self.weight_dtype)
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(
        jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return (normed * jnp.asarray(scale, jnp.float32)).astype(self.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, min_timescale: float,
               max_timescale: float) -> jax.Array:
  """Rotary position embedding on [B, S, heads, D] (halves rotated, as in
  MaxText's RotaryEmbedding)."""
  head_dim = x.shape[-1]
  fraction = 2 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
  timescale = min_timescale * (max_timescale / min_timescale) ** fraction
  angle = positions[:, :, None, None].astype(jnp.float32) / timescale
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate(
      [first * cos - second * sin, second * cos + first * sin], axis=-1)
  return rotated.astype(x.dtype)


class Attention(nn.Module):
  """Causal grouped-query self-attention with RoPE.

  Projection kernels are 2-D with heads and head_dim fused ([E, H*D] and
  [H*D, E]): `nn.DenseGeneral` reshapes a 2-D initial kernel into its final
  shape, which a logically partitioned initialiser cannot survive under a
  mesh. Sharding the fused dim over 'tensor' splits at head boundaries
  because the head count divides the tensor axis (checked in config).

  With `fused_qkv`, one kernel `qkv_proj` [E, K, G + 2, D] (G = H / K query
  heads per kv head) makes query, key and value in one matmul: for kv head k,
  slots 0..G-1 are query heads k*G .. k*G+G-1, slot G its key head, slot G+1
  its value head. The kv-head dim is the one sharded over 'tensor', so each
  device holds whole kv groups: its query heads with the key and value heads
  they attend with. (MaxText's kernel [E, 3, H, D] has no room for GQA; for
  H == K this is the same kernel with its two middle dims swapped.)
  """
  config: config_lib.Config

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    cfg = self.config
    batch, length, _ = x.shape
    head_dim, kv_heads = cfg.head_dim, cfg.num_kv_heads
    q_features, kv_features = cfg.num_query_heads * head_dim, kv_heads * head_dim
    group = cfg.num_query_heads // kv_heads
    if cfg.fused_qkv:
      qkv = FusedProjection(
          cfg, features=(kv_heads, group + 2, head_dim),
          lhs_axes=BLOCK_ACTIVATION_AXES,
          kernel_axes=("embed", "kv_heads", "qkv", "kv"),
          name="qkv_proj")(x)  # [B, S, K, G + 2, D]
      query = qkv[:, :, :, :group]
      key, value = qkv[:, :, :, group], qkv[:, :, :, group + 1]
    else:
      query, key, value = sibling_projections(self, x, (
          ("query", q_features, ("embed", "heads")),
          ("key", kv_features, ("embed", "kv_heads")),
          ("value", kv_features, ("embed", "kv_heads"))))
    query = nn.with_logical_constraint(
        query.reshape(batch, length, cfg.num_query_heads, head_dim),
        ATTENTION_AXES)
    key_value_axes = ("activation_batch", "activation_length",
                      "activation_kv_heads", "activation_kv")
    key = nn.with_logical_constraint(
        key.reshape(batch, length, kv_heads, head_dim), key_value_axes)
    value = nn.with_logical_constraint(
        value.reshape(batch, length, kv_heads, head_dim), key_value_axes)

    query = apply_rope(query, positions, cfg.rope_min_timescale,
                       cfg.rope_max_timescale)
    key = apply_rope(key, positions, cfg.rope_min_timescale,
                     cfg.rope_max_timescale)

    # [B, S, K, G, D]: each kv head serves `group` consecutive query heads.
    query = query.reshape(batch, length, kv_heads, group, head_dim)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", query, key,
                        preferred_element_type=jnp.float32)
    logits = logits / jnp.sqrt(jnp.float32(head_dim))
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    attended = jnp.einsum("bkgqs,bskd->bqkgd", weights, value)
    attended = nn.with_logical_constraint(
        attended.reshape(batch, length, q_features), ATTENTION_OUTPUT_AXES)
    return _projection(self, "out", cfg.emb_dim, ATTENTION_OUTPUT_AXES,
                       ("heads", "embed"),
                       out_axes=_output_projection_axes(cfg))(attended)


class MlpBlock(nn.Module):
  """Gated SiLU MLP: wo(silu(wi_0 x) * wi_1 x), MaxText's layer names.

  With `fused_mlp`, MaxText's fused layout: one kernel `wi` [E, 2, M] with
  axes ('embed', 'num_activations', 'mlp') and one matmul to [B, S, 2, M],
  index 0 the gate, 1 the linear half.
  """
  config: config_lib.Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    if cfg.fused_mlp:
      fused = FusedProjection(
          cfg, features=(len(cfg.mlp_activations), cfg.mlp_dim),
          lhs_axes=BLOCK_ACTIVATION_AXES,
          kernel_axes=("embed", "num_activations", "mlp"), name="wi")(x)
      gate, up = fused[:, :, 0], fused[:, :, 1]
    else:
      gate, up = sibling_projections(self, x, (
          ("wi_0", cfg.mlp_dim, ("embed", "mlp")),
          ("wi_1", cfg.mlp_dim, ("embed", "mlp"))))
    hidden = nn.silu(gate) * up
    hidden = nn.with_logical_constraint(hidden, MLP_ACTIVATION_AXES)
    return _projection(self, "wo", cfg.emb_dim, MLP_ACTIVATION_AXES,
                       ("mlp", "embed"),
                       out_axes=_output_projection_axes(cfg))(hidden)


class DecoderLayer(nn.Module):
  """Pre-norm attention and MLP, each with a residual."""
  config: config_lib.Config

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    cfg = self.config
    norm = dict(epsilon=cfg.normalization_layer_epsilon,
                dtype=_dtype(cfg.dtype), weight_dtype=_dtype(cfg.weight_dtype))
    x = nn.with_logical_constraint(x, BLOCK_ACTIVATION_AXES)
    h = RMSNorm(name="pre_self_attention_layer_norm", **norm)(x)
    h = nn.with_logical_constraint(h, BLOCK_ACTIVATION_AXES)
    x = x + Attention(cfg, name="self_attention")(h, positions)
    x = nn.with_logical_constraint(x, BLOCK_ACTIVATION_AXES)
    h = RMSNorm(name="post_self_attention_layer_norm", **norm)(x)
    h = nn.with_logical_constraint(h, BLOCK_ACTIVATION_AXES)
    x = x + MlpBlock(cfg, name="mlp")(h)
    return nn.with_logical_constraint(x, BLOCK_ACTIVATION_AXES)


class Transformer(nn.Module):
  """Token ids [B, S] -> logits [B, S, V] (float32)."""
  config: config_lib.Config

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.config
    embedder = nn.Embed(
        num_embeddings=cfg.vocab_size, features=cfg.emb_dim,
        dtype=_dtype(cfg.dtype), param_dtype=_dtype(cfg.weight_dtype),
        embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(stddev=1.0), ("vocab", "embed")),
        name="token_embedder")
    x = embedder(tokens).astype(_dtype(cfg.dtype))
    x = nn.with_logical_constraint(x, BLOCK_ACTIVATION_AXES)
    positions = jnp.broadcast_to(
        jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    for i in range(cfg.num_decoder_layers):
      x = DecoderLayer(cfg, name=f"layers_{i}")(x, positions)
    x = RMSNorm(epsilon=cfg.normalization_layer_epsilon,
                dtype=_dtype(cfg.dtype), weight_dtype=_dtype(cfg.weight_dtype),
                name="decoder_norm")(x)
    x = nn.with_logical_constraint(x, BLOCK_ACTIVATION_AXES)
    logits_axes = ("activation_batch", "activation_length", "activation_vocab")
    if cfg.logits_via_embedding:
      logits = embedder.attend(x)
    else:
      logits = _projection(self, "logits_dense", cfg.vocab_size,
                           BLOCK_ACTIVATION_AXES, ("embed", "vocab"))(x)
    logits = nn.with_logical_constraint(logits, logits_axes)
    return logits.astype(jnp.float32)


def count_params(config: config_lib.Config) -> int:
  """Parameters of the model `config` describes (for the MFU estimate)."""
  e, m, v, d = config.emb_dim, config.mlp_dim, config.vocab_size, config.head_dim
  attention = e * d * (2 * config.num_query_heads + 2 * config.num_kv_heads)
  per_layer = attention + 3 * e * m + 2 * e
  embedding = v * e * (1 if config.logits_via_embedding else 2)
  return config.num_decoder_layers * per_layer + embedding + e


def training_flops_per_token(config: config_lib.Config) -> float:
  """Model FLOPs per trained token: 6 x matmul params (forward + backward)
  plus causal attention scores (MaxText's calculate_tflops_training_per_device
  counts the same terms)."""
  e, m, d = config.emb_dim, config.mlp_dim, config.head_dim
  layers, seq = config.num_decoder_layers, config.max_target_length
  matmul_params = layers * (
      e * d * (2 * config.num_query_heads + 2 * config.num_kv_heads)
      + 3 * e * m) + e * config.vocab_size
  attention = layers * 2 * 2 * seq * config.num_query_heads * d / 2  # causal
  return 6.0 * matmul_params + 3.0 * attention
