"""MaxText's fused projections (fused_mlp, fused_qkv) compute the same model
as the unfused layers, and their slot dims stay unsharded."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import collective_matmul as cm
from reference_host import config as config_lib
from reference_host import model as model_lib

from host_test_utils import BASE_CONFIG, TEST_MODEL_ARGS

FUSED = ("fused_mlp=True", "fused_qkv=True")


def _fuse(params, config):
  """The unfused parameter tree rewritten into the fused layers' kernels."""
  kv, group = config.num_kv_heads, config.num_query_heads // config.num_kv_heads
  emb, d = config.emb_dim, config.head_dim
  fused = {}
  for name, layer in params.items():
    if not name.startswith("layers_"):
      fused[name] = layer
      continue
    layer = dict(layer)
    mlp = dict(layer["mlp"])
    mlp["wi"] = {"kernel": jnp.stack(
        [mlp.pop("wi_0")["kernel"], mlp.pop("wi_1")["kernel"]], axis=1)}
    attention = dict(layer["self_attention"])
    # Query head h = k * group + g serves kv head k.
    query = attention.pop("query")["kernel"].reshape(emb, kv, group, d)
    key = attention.pop("key")["kernel"].reshape(emb, kv, 1, d)
    value = attention.pop("value")["kernel"].reshape(emb, kv, 1, d)
    attention["qkv_proj"] = {
        "kernel": jnp.concatenate([query, key, value], axis=2)}
    layer["mlp"], layer["self_attention"] = mlp, attention
    fused[name] = layer
  return fused


@pytest.mark.parametrize("kv_heads", [8, 4, 1])  # MHA, GQA, MQA (8 q heads)
def test_fused_layers_compute_the_unfused_model(rng, kv_heads):
  args = [BASE_CONFIG, *TEST_MODEL_ARGS, f"base_num_kv_heads={kv_heads}"]
  config = config_lib.load_config(args)
  fused_config = config_lib.load_config(args + list(FUSED))
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 16)), jnp.int32)
  with cm.config_context(cm.CollectiveMatmulConfig(enabled=False)):
    model = model_lib.Transformer(config)
    params = model.init(jax.random.key(int(rng.integers(1 << 30))),
                        tokens)["params"]
    params = jax.tree.map(np.asarray, nn.meta.unbox(params))
    fused_model = model_lib.Transformer(fused_config)
    fused_shapes = jax.eval_shape(fused_model.init, jax.random.key(0),
                                  tokens)["params"]
    fused_params = _fuse(params, config)
    assert (jax.tree.map(lambda x: x.shape, nn.meta.unbox(fused_shapes))
            == jax.tree.map(lambda x: x.shape, fused_params))
    expected = model.apply({"params": params}, tokens)
    actual = fused_model.apply({"params": fused_params}, tokens)
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key,logical", [("fused_mlp", "num_activations"),
                                         ("fused_qkv", "qkv")])
def test_sharded_fused_slot_dim_is_an_error_naming_the_keys(key, logical):
  rules = (f'logical_axis_rules=[["{logical}","tensor"],["mlp","tensor"],'
           '["heads","tensor"],["kv_heads","tensor"]]')
  with pytest.raises(config_lib.ConfigError, match=f"{key}.*{logical}"):
    config_lib.load_config([BASE_CONFIG, "model_name=tiny", f"{key}=True",
                            rules])
  config_lib.load_config([BASE_CONFIG, "model_name=tiny", rules])  # unfused
