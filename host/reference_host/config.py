"""MaxText-style configuration: base YAML, model overlay, key=value overrides.

`load_config(["model_configs/base.yml", "model_name=tiny", "steps=5"])` reads
the base file, applies `model_configs/<model_name>.yml` on top, then the
command-line overrides, and checks everything that can be checked without a
device program: unknown keys, value types, supported values, and (given the
device count) that the mesh and the batch divide. Every error names the key.
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping, Sequence

import yaml


class ConfigError(ValueError):
  """A configuration problem, reported before anything is compiled."""


# Older MaxText model files (e.g. mistral-7b.yml) spell some keys differently.
KEY_ALIASES = {"rms_norm_epsilon": "normalization_layer_epsilon"}

# Keys whose values this host can honour only at the given value: MaxText
# model files set them, so they must load, but a different value asks for a
# feature this llama-style host does not have.
UNSUPPORTED_UNLESS = {
    "num_experts": 1,
    "num_experts_per_tok": 1,
    "use_qk_norm": False,
    "use_post_attn_norm": False,
    "use_post_ffw_norm": False,
    "final_logits_soft_cap": 0.0,
    "attn_logits_soft_cap": 0.0,
    "sliding_window_size": 0,
    "ici_fsdp_parallelism": 1,
    "dataset_type": "synthetic",
}
# MaxText writes "no soft cap" as null in some files.
_NULL_MEANS_DEFAULT = {"final_logits_soft_cap", "attn_logits_soft_cap"}

SUPPORTED_VALUES = {
    "decoder_block": ("llama2", "mistral"),
    "attention": ("dot_product", "autoselected"),
    "dtype": ("float32", "bfloat16", "float16"),
    "weight_dtype": ("float32", "bfloat16"),
    "matmul_precision": ("default", "high", "highest"),
}
SUPPORTED_MLP_ACTIVATIONS = (["silu", "linear"],)
MESH_AXES = ("data", "tensor")
# The logical axis of each fused layer's slot dim (see model.py).
FUSED_SLOT_AXES = {"fused_mlp": "num_activations", "fused_qkv": "qkv"}


def default_model_dir(base_config_path: str) -> str:
  """Model files live next to the base file, as in MaxText's configs/."""
  return os.path.dirname(os.path.abspath(base_config_path))


def _read_yaml(path: str, what: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    raise ConfigError(f"{what}: file not found: {path}")
  with open(path) as f:
    data = yaml.safe_load(f)
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"{what}: {path} must hold a mapping of keys to values")
  return data


def _canonical_key(key: str) -> str:
  return KEY_ALIASES.get(key, key)


def _coerce(key: str, value: Any, default: Any, source: str) -> Any:
  """Checks `value` against the type of the base default (MaxText's rule)."""
  if key in _NULL_MEANS_DEFAULT and value is None:
    return default
  if default is None or value is None:
    return value
  if isinstance(default, bool):
    if isinstance(value, bool):
      return value
  elif isinstance(default, int):
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    # per_device_batch_size may be fractional in MaxText.
    if isinstance(value, float) and key == "per_device_batch_size":
      return value
  elif isinstance(default, float):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  elif isinstance(default, str):
    if isinstance(value, str):
      return value
  elif isinstance(default, list):
    if isinstance(value, (list, tuple)):
      return list(value)
  else:
    return value
  raise ConfigError(
      f"{key}={value!r} (from {source}) has type {type(value).__name__}, "
      f"expected {type(default).__name__} like the default {default!r}")


def _apply(values: dict[str, Any], updates: Mapping[str, Any], source: str,
           defaults: Mapping[str, Any]) -> None:
  unknown = sorted(k for k in updates if _canonical_key(k) not in defaults)
  if unknown:
    raise ConfigError(
        f"unknown config key(s) {', '.join(unknown)} in {source} (every key "
        "must be defined in base.yml)")
  for key, value in updates.items():
    key = _canonical_key(key)
    values[key] = _coerce(key, value, defaults[key], source)


def parse_overrides(args: Iterable[str]) -> dict[str, Any]:
  """`["steps=5", "dtype=float32"]` -> `{"steps": 5, "dtype": "float32"}`.

  Values are parsed as YAML, so numbers, booleans and lists keep their type.
  """
  overrides = {}
  for arg in args:
    key, sep, text = arg.partition("=")
    if not sep or not key:
      raise ConfigError(f"expected key=value, got {arg!r}")
    try:
      overrides[key] = yaml.safe_load(text) if text else ""
    except yaml.YAMLError as e:
      raise ConfigError(f"{key}: cannot parse value {text!r}: {e}") from e
  return overrides


class Config:
  """A loaded, validated configuration; read keys as attributes.

  Derived, MaxText-named attributes: `emb_dim`, `num_query_heads`,
  `num_kv_heads`, `mlp_dim`, `num_decoder_layers`, `tensor_parallelism`.
  Device-dependent ones (`data_parallelism`, `global_batch_size`) come from
  `resolve_for_devices`.
  """

  def __init__(self, values: Mapping[str, Any]):
    object.__setattr__(self, "_values", dict(values))

  def __getattr__(self, key: str) -> Any:
    values = object.__getattribute__(self, "_values")
    if key in values:
      return values[key]
    raise AttributeError(f"config has no key {key!r}")

  def __setattr__(self, key, value):
    raise AttributeError("Config is read-only; use replace(**updates)")

  def __getitem__(self, key: str) -> Any:
    return self._values[key]

  def to_dict(self) -> dict[str, Any]:
    return dict(self._values)

  def replace(self, **updates) -> "Config":
    values = self.to_dict()
    values.update(updates)
    return Config(values)

  def __repr__(self):
    return f"Config({self._values!r})"

  @property
  def emb_dim(self) -> int:
    return self.base_emb_dim

  @property
  def num_query_heads(self) -> int:
    return self.base_num_query_heads

  @property
  def num_kv_heads(self) -> int:
    return self.base_num_kv_heads

  @property
  def mlp_dim(self) -> int:
    return self.base_mlp_dim

  @property
  def num_decoder_layers(self) -> int:
    return self.base_num_decoder_layers

  @property
  def tensor_parallelism(self) -> int:
    return self.ici_tensor_parallelism * self.ici_tensor_sequence_parallelism

  @property
  def checkpoint_directory(self) -> str:
    if self.checkpoint_dir:
      return os.path.abspath(self.checkpoint_dir)
    return os.path.abspath(os.path.join(
        self.base_output_directory, self.run_name, "checkpoints"))


def _validate_values(values: Mapping[str, Any]) -> None:
  for key, allowed in SUPPORTED_VALUES.items():
    if values[key] not in allowed:
      raise ConfigError(
          f"{key}={values[key]!r} is not supported; expected one of {allowed}")
  for key, required in UNSUPPORTED_UNLESS.items():
    if values[key] != required:
      raise ConfigError(
          f"{key}={values[key]!r} is not supported by this llama-style host "
          f"(only {required!r})")
  if values["mlp_activations"] not in SUPPORTED_MLP_ACTIVATIONS:
    raise ConfigError(
        f"mlp_activations={values['mlp_activations']!r} is not supported; "
        'expected ["silu", "linear"] (gated SiLU)')
  if tuple(values["mesh_axes"]) != MESH_AXES:
    raise ConfigError(f"mesh_axes={values['mesh_axes']!r}: this host builds "
                      f"the mesh {list(MESH_AXES)}")
  for key in ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads",
              "base_mlp_dim", "base_num_decoder_layers", "head_dim",
              "vocab_size", "max_target_length", "steps", "log_period",
              "checkpoint_period", "max_num_checkpoints_to_keep"):
    if values[key] <= 0:
      raise ConfigError(f"{key}={values[key]} must be positive")
  if values["per_device_batch_size"] <= 0:
    raise ConfigError(
        f"per_device_batch_size={values['per_device_batch_size']} must be "
        "positive")
  if values["base_num_query_heads"] % values["base_num_kv_heads"]:
    raise ConfigError(
        f"base_num_query_heads={values['base_num_query_heads']} is not a "
        f"multiple of base_num_kv_heads={values['base_num_kv_heads']}")
  if values["head_dim"] % 2:
    raise ConfigError(f"head_dim={values['head_dim']} must be even for RoPE")
  for key in ("ici_tensor_parallelism", "ici_tensor_sequence_parallelism"):
    if values[key] < 1:
      raise ConfigError(f"{key}={values[key]} must be >= 1")
  if values["ici_data_parallelism"] == 0 or values["ici_data_parallelism"] < -1:
    raise ConfigError(f"ici_data_parallelism={values['ici_data_parallelism']}"
                      " must be -1 (fill) or >= 1")
  for rule in values["logical_axis_rules"]:
    if (not isinstance(rule, (list, tuple)) or len(rule) != 2
        or not isinstance(rule[0], str)):
      raise ConfigError(f"logical_axis_rules: bad rule {rule!r}; expected "
                        "[logical_name, mesh_axis or list or null]")
    mesh_axes = rule[1] if isinstance(rule[1], (list, tuple)) else [rule[1]]
    for axis in mesh_axes:
      if axis is not None and axis not in MESH_AXES:
        raise ConfigError(f"logical_axis_rules: rule {rule!r} names mesh axis "
                          f"{axis!r}, not one of {list(MESH_AXES)}")
  # The fused layers' slot dims (gate/linear, query/key/value) must stay
  # unsharded: each device computes whole heads / MLP features of every slot,
  # and the plugin's rewrite needs the kernel's other output dims unsharded.
  for key, logical in FUSED_SLOT_AXES.items():
    mapped = [rule[1] for rule in values["logical_axis_rules"]
              if rule[0] == logical]
    if values[key] and mapped and mapped[0] not in (None, [], ()):
      raise ConfigError(
          f"{key}=True needs logical axis {logical!r} unsharded, but "
          f"logical_axis_rules maps it to {mapped[0]!r}")

  tensor = (values["ici_tensor_parallelism"]
            * values["ici_tensor_sequence_parallelism"])
  # Everything sharded over 'tensor' must divide evenly: the sequence of the
  # activations between blocks, heads, MLP features and the vocabulary.
  for key in ("max_target_length", "base_num_query_heads", "base_num_kv_heads",
              "base_mlp_dim", "vocab_size"):
    if values[key] % tensor:
      raise ConfigError(
          f"{key}={values[key]} is not divisible by the tensor axis size "
          f"{tensor} (ici_tensor_parallelism={values['ici_tensor_parallelism']}"
          " x ici_tensor_sequence_parallelism="
          f"{values['ici_tensor_sequence_parallelism']})")


def resolve_for_devices(config: Config, num_devices: int) -> Config:
  """Fills the mesh sizes for `num_devices` and checks the batch divides.

  Returns a config with `data_parallelism` and `global_batch_size` set.
  """
  tensor = config.tensor_parallelism
  data = config.ici_data_parallelism
  if data == -1:
    if num_devices % tensor:
      raise ConfigError(
          f"ici_tensor_parallelism x ici_tensor_sequence_parallelism = {tensor}"
          f" does not divide the {num_devices} devices")
    data = num_devices // tensor
  if data * tensor != num_devices:
    raise ConfigError(
        f"ici_data_parallelism={config.ici_data_parallelism} x tensor axis "
        f"{tensor} (ici_tensor_parallelism x ici_tensor_sequence_parallelism) "
        f"= {data * tensor} does not match the {num_devices} devices")
  global_batch = config.per_device_batch_size * num_devices
  if not math.isclose(global_batch, round(global_batch)) or global_batch < 1:
    raise ConfigError(
        f"per_device_batch_size={config.per_device_batch_size} x "
        f"{num_devices} devices = {global_batch} is not a whole batch")
  global_batch = int(round(global_batch))
  if global_batch % data:
    raise ConfigError(
        f"per_device_batch_size={config.per_device_batch_size} gives a global "
        f"batch of {global_batch}, not divisible by the data axis size {data} "
        "(ici_data_parallelism)")
  return config.replace(data_parallelism=data, global_batch_size=global_batch)


def load_config(argv: Sequence[str], *, model_dir: str | None = None,
                num_devices: int | None = None) -> Config:
  """Loads `argv = [base.yml, key=value, ...]` MaxText-style.

  Args:
    argv: the base config path, then key=value overrides (`model_name=NAME`
      pulls `<model_dir>/NAME.yml` between the base and the overrides).
    model_dir: where model files live; default: the base file's directory.
    num_devices: when given, also resolves and checks the mesh and batch.
  """
  if not argv:
    raise ConfigError("expected a config file as the first argument")
  base_path, *override_args = argv
  defaults = _read_yaml(base_path, "base config")
  values = dict(defaults)
  overrides = parse_overrides(override_args)

  # The model file applies before command-line overrides, so `model_name`
  # from the command line or from the base file selects it.
  model_name = overrides.get("model_name", values.get("model_name", "default"))
  if model_name != "default":
    model_dir = model_dir or default_model_dir(base_path)
    model_path = os.path.join(model_dir, f"{model_name}.yml")
    if not os.path.isfile(model_path):
      available = sorted(
          f[:-4] for f in os.listdir(model_dir)
          if f.endswith(".yml") and f != os.path.basename(base_path))
      raise ConfigError(
          f"model_name={model_name!r}: no model file {model_path} "
          f"(available: {', '.join(available)})")
    _apply(values, _read_yaml(model_path, f"model_name={model_name}"),
           model_path, defaults)
  _apply(values, overrides, "command-line overrides", defaults)
  _validate_values(values)
  config = Config(values)
  if num_devices is not None:
    config = resolve_for_devices(config, num_devices)
  return config
