"""Runs MaxText's trainer (stock, or through the plugin's launcher) in a
subprocess on 8 emulated CPU devices, and reads back what it wrote."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

WORK = tempfile.mkdtemp(prefix="cm_maxtext_")
# One compile cache for every run of the session: identical programs (stock
# and plugin-off) compile once.
CACHE = os.path.join(WORK, "jax_cache")

# Shrunk models: two families, MHA (llama2) and GQA (llama3).
MODELS = {
    "llama2-7b": ("base_emb_dim=256", "base_mlp_dim=512",
                  "base_num_query_heads=4", "base_num_kv_heads=4",
                  "head_dim=64"),
    "llama3-8b": ("base_emb_dim=256", "base_mlp_dim=512",
                  "base_num_query_heads=8", "base_num_kv_heads=2",
                  "head_dim=32"),
    "mistral-7b": ("base_emb_dim=256", "base_mlp_dim=512",
                   "base_num_query_heads=8", "base_num_kv_heads=4",
                   "head_dim=32"),
    # gemma4_small: per-layer inputs (the embeddings' projection into them,
    # their gate and projection in every decoder layer), tied logits, the
    # second layer's key/value shared from the first (its donor computes
    # them outside Attention.__call__); layers unscanned, as it requires.
    "gemma4-e2b": ("base_emb_dim=256", "base_mlp_dim=512",
                   "base_num_query_heads=8", "base_num_kv_heads=4",
                   "head_dim=32", "global_head_dim=64",
                   "global_num_kv_heads=4", "scan_layers=False",
                   "hidden_size_per_layer_input=32",
                   "vocab_size_per_layer_input=1024",
                   "num_kv_shared_layers=1"),
    # gpt3's own attention class, fused query/key/value.
    "gpt3-52k": ("base_emb_dim=256", "base_mlp_dim=512",
                 "base_num_query_heads=8", "base_num_kv_heads=8",
                 "head_dim=32"),
    # MLA attention; one dense layer, then a MoE layer with shared experts.
    "deepseek3-tiny": ("base_emb_dim=256", "base_mlp_dim=512",
                       "base_num_query_heads=8", "base_num_kv_heads=8",
                       "first_num_dense_layers=1", "q_lora_rank=64",
                       "kv_lora_rank=32", "qk_nope_head_dim=32",
                       "qk_rope_head_dim=16", "v_head_dim=32",
                       "num_experts=4", "num_experts_per_tok=2",
                       "base_moe_mlp_dim=512", "megablox=False"),
}
MESHES = {
    "ts4_data2": ("ici_tensor_sequence_parallelism=4",
                  "ici_data_parallelism=2", "ici_fsdp_parallelism=1"),
    "ts2_data2_fsdp2": ("ici_tensor_sequence_parallelism=2",
                        "ici_data_parallelism=2", "ici_fsdp_parallelism=2"),
    "tensor4_data2": ("ici_tensor_parallelism=4", "ici_data_parallelism=2",
                      "ici_fsdp_parallelism=1"),
}
DTYPES = {"bf16": ("dtype=bfloat16", "weight_dtype=float32"),
          "f32": ("dtype=float32", "weight_dtype=float32",
                  "matmul_precision=highest")}


def maxtext_base_yml() -> str:
  import maxtext  # pylint: disable=g-import-not-at-top
  return os.path.join(os.path.dirname(maxtext.__file__), "configs",
                      "base.yml")


@dataclasses.dataclass(frozen=True)
class Run:
  """What one training run printed and wrote."""

  name: str
  stdout: str
  losses: dict[int, float]
  checkpoint_dir: str

  def checkpoint(self, step: int) -> dict[str, np.ndarray]:
    return read_checkpoint(os.path.join(self.checkpoint_dir, str(step),
                                        "items"))

  def decision_lines(self) -> list[str]:
    return [line.strip() for line in self.stdout.splitlines()
            if line.startswith("  ") and (" rewritten -> " in line or
                                          "left to XLA" in line)]


def train(name: str, *, model="llama2-7b", mesh="ts4_data2", dtype="bf16",
          plugin: tuple[str, ...] | None = (), steps=3, run_name=None,
          extra: tuple[str, ...] = (), xla_flash_attention=False) -> Run:
  """Trains `model` for `steps` steps with synthetic data.

  plugin: None runs stock MaxText (`maxtext.trainers.pre_train.train`);
    a tuple runs the plugin's launcher with these flags (empty: plugin off).
  run_name: reuse another run's output directory (to resume it).
  xla_flash_attention: MaxText's GPU flash attention call
    (`attention=flash`) with tokamax's XLA attention as its kernel
    (`launch_with_xla_attention.py`; the plugin's launcher).
  """
  run_name = run_name or name
  metrics = os.path.join(WORK, f"{name}.metrics.jsonl")
  if xla_flash_attention:
    launch = [os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "launch_with_xla_attention.py")]
    extra = (*extra, "attention=flash")
  else:
    launch = ["-m", "maxtext.trainers.pre_train.train" if plugin is None
              else "collective_matmul.integrations.maxtext"]
  argv = [sys.executable, *launch, maxtext_base_yml(),
          f"run_name={run_name}", f"base_output_directory={WORK}",
          "hardware=cpu", "skip_jax_distributed_system=True",
          "dataset_type=synthetic", f"model_name={model}",
          "override_model_config=True", "base_num_decoder_layers=2",
          "vocab_size=1024", "max_target_length=128",
          "per_device_batch_size=1", f"steps={steps}",
          "enable_checkpointing=True", "async_checkpointing=False",
          "checkpoint_period=2", f"metrics_file={metrics}",
          f"jax_cache_dir={CACHE}", *MODELS[model], *MESHES[mesh],
          *DTYPES[dtype], *extra, *(plugin or ())]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8",
             TF_CPP_MIN_LOG_LEVEL="2")
  result = subprocess.run(argv, capture_output=True, text=True, env=env,
                          timeout=900, cwd=WORK)
  if result.returncode != 0:
    raise AssertionError(f"{name} failed ({result.returncode}):\n"
                         f"{' '.join(argv)}\n{result.stderr[-6000:]}")
  losses = {}
  with open(metrics) as f:
    for line in f:
      record = json.loads(line)
      losses[int(record["step"])] = float(record["learning/loss"])
  return Run(name, result.stdout, losses,
             os.path.join(WORK, run_name, "checkpoints"))


@functools.lru_cache(maxsize=None)
def cached_train(name: str, **kwargs) -> Run:
  """`train`, once per distinct name in the test session."""
  return train(name, **kwargs)


def read_checkpoint(items_dir: str) -> dict[str, np.ndarray]:
  """Every array of an orbax PyTree checkpoint, by key path."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(items_dir).item_metadata.tree
  is_leaf = lambda x: not isinstance(x, (dict, list, tuple))
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                      tree, is_leaf=is_leaf)
  restored = checkpointer.restore(items_dir, restore_args=args)
  return {jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(restored)}
