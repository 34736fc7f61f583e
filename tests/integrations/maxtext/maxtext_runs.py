"""Runs MaxText's trainer (stock, or through the plugin's launcher) in a
subprocess on 8 emulated CPU devices (several at once where a test asks:
`cached_train_together`), and reads back what it wrote."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

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


def start(name: str, *, model="llama2-7b", mesh="ts4_data2", dtype="bf16",
          plugin: tuple[str, ...] | None = (), steps=3, run_name=None,
          extra: tuple[str, ...] = (), xla_flash_attention=False,
          checkpoints=True, launcher: str | None = None) -> Training:
  """Starts training `model` for `steps` steps with synthetic data (its
  own process; `Training.result` waits for it).

  plugin: None runs stock MaxText (`maxtext.trainers.pre_train.train`);
    a tuple runs the plugin's launcher with these flags (empty: plugin off).
  run_name: reuse another run's output directory (to resume it).
  xla_flash_attention: MaxText's GPU flash attention call
    (`attention=flash`) with tokamax's XLA attention as its kernel
    (`launch_with_xla_attention.py`; the plugin's launcher).
  checkpoints: False saves none (`enable_checkpointing=False`; about 3 s
    less a run on CPU): for runs whose checkpoints no test reads.
  launcher: a script of this folder that runs the plugin's launcher (e.g.
    with a planted bug: `launch_with_per_tensor_scales.py`), or None.
  """
  run_name = run_name or name
  metrics = os.path.join(WORK, f"{name}.metrics.jsonl")
  here = os.path.dirname(os.path.abspath(__file__))
  if xla_flash_attention:
    launch = [os.path.join(here, "launch_with_xla_attention.py")]
    extra = (*extra, "attention=flash")
  elif launcher is not None:
    launch = [os.path.join(here, launcher)]
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
          f"enable_checkpointing={checkpoints}", "async_checkpointing=False",
          "checkpoint_period=2", f"metrics_file={metrics}",
          f"jax_cache_dir={CACHE}", *MODELS[model], *MESHES[mesh],
          *DTYPES[dtype], *extra, *(plugin or ())]
  return Training(name, argv, metrics,
                  os.path.join(WORK, run_name, "checkpoints"))


class Training:
  """One run of MaxText's trainer in its own process, started."""

  TIMEOUT_S = 900

  def __init__(self, name: str, argv: list[str], metrics: str,
               checkpoint_dir: str):
    self.name, self._argv = name, argv
    self._metrics, self._checkpoint_dir = metrics, checkpoint_dir
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8",
               TF_CPP_MIN_LOG_LEVEL="2")
    # Files, not pipes: a run that nobody reads yet (another's result is
    # awaited first) must not block on a full pipe.
    self._stdout = os.path.join(WORK, f"{name}.stdout")
    self._stderr = os.path.join(WORK, f"{name}.stderr")
    self._deadline = time.monotonic() + self.TIMEOUT_S
    with open(self._stdout, "w") as out, open(self._stderr, "w") as err:
      self._process = subprocess.Popen(argv, stdout=out, stderr=err,
                                       text=True, env=env, cwd=WORK)

  def result(self) -> Run:
    """Waits for the run (at most TIMEOUT_S from its start) and reads what
    it printed and wrote; AssertionError where it failed."""
    try:
      returncode = self._process.wait(
          timeout=max(0.0, self._deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      self.stop()
      raise
    with open(self._stdout) as out, open(self._stderr) as err:
      stdout, stderr = out.read(), err.read()
    if returncode != 0:
      raise AssertionError(f"{self.name} failed ({returncode}):\n"
                           f"{' '.join(self._argv)}\n{stderr[-6000:]}")
    losses = {}
    with open(self._metrics) as f:
      for line in f:
        record = json.loads(line)
        losses[int(record["step"])] = float(record["learning/loss"])
    return Run(self.name, stdout, losses, self._checkpoint_dir)

  def stop(self) -> None:
    """Kills the run's process if it still runs."""
    if self._process.poll() is None:
      self._process.kill()
      self._process.wait()


def train(name: str, **kwargs) -> Run:
  """`start(name, **kwargs)`, waited for."""
  return start(name, **kwargs).result()


_RUNS: dict[tuple, Run] = {}


def cached_train(name: str, **kwargs) -> Run:
  """`train`, once per distinct name and arguments in the test session."""
  return cached_train_together((name, kwargs))[0]


def cached_train_together(*runs: tuple[str, dict[str, Any]]) -> list[Run]:
  """`cached_train(name, **kwargs)` for each (name, kwargs) in `runs`, those
  not made yet in processes at once: a run keeps about one core busy
  (Python's imports, XLA's compile), so on CI's 2 cores a plugin on/off pair
  takes about 35 % less wall time together than one after the other. Runs
  started together each compile their programs (the compile cache serves a
  program only once it is written): runs of one program (stock and plugin
  off) belong in separate calls."""
  keys = [(name, tuple(sorted(kwargs.items()))) for name, kwargs in runs]
  started = {}
  try:
    for key, (name, kwargs) in zip(keys, runs):
      if key not in _RUNS and key not in started:
        started[key] = start(name, **kwargs)
    for key, training in started.items():
      _RUNS[key] = training.result()
  finally:
    for training in started.values():
      training.stop()
  return [_RUNS[key] for key in keys]


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
