"""MaxText-style configuration: base YAML, model overlay, key=value overrides.

`load_config(["model_configs/base.yml", "model_name=tiny", "steps=5"])` reads
the base file, applies `model_configs/<model_name>.yml` on top, then the
command-line overrides, and checks everything that can be checked without a
device program: unknown keys, value types, supported values, the logical
axis rules, and (given the device count) that the mesh and the batch divide.
Every error names the key.

The mesh has MaxText's mesh axes (`MESH_AXES`), each sized by its
`ici_<axis>_parallelism` key, so MaxText model files, whose
`logical_axis_rules` name those axes, load unchanged. Their rules are merged
into the base rules as MaxText's pyconfig merges them
(`merge_logical_axis_rules`).
"""
from __future__ import annotations

import difflib
import math
import os
from typing import Any, Iterable, Mapping, Sequence

import yaml


class ConfigError(ValueError):
  """A configuration problem, reported before anything is compiled."""


# Keys only a base config defines (a model file given as the base lacks them).
BASE_ONLY_KEYS = ("steps", "run_name", "logical_axis_rules")
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
    # Mesh axes that are not a sharding but a training scheme this host does
    # not run (pipeline stages, DiLoCo's outer optimizer).
    "ici_pipeline_parallelism": 1,
    "ici_diloco_parallelism": 1,
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
# Keys MaxText has that this host accepts (model files set them) but does not
# implement: only the value that means "off" is accepted, any other is
# refused like an unsupported feature rather than silently ignored.
NOT_IMPLEMENTED_UNLESS = {
    "enable_dropout": (False, "dropout"),
    "dropout_rate": (0.0, "dropout"),
}


# Value checks, MaxText pyconfig style: one small named validator per rule,
# each returning what the value must be when it is not (None when it is).
def _greater_than(bound):
  def greater_than(value):
    return None if value > bound else f"must be > {bound}"
  return greater_than


def _at_least(bound):
  def at_least(value):
    return None if value >= bound else f"must be >= {bound}"
  return at_least


def _in_half_open(low, high):
  def in_half_open(value):
    return None if low <= value < high else f"must be in [{low}, {high})"
  return in_half_open


def _seed(value):
  return (None if 0 <= value < 2**63
          else "must be a seed in [0, 2**63)")


VALUE_VALIDATORS = {
    "learning_rate": _greater_than(0),
    "adam_b1": _in_half_open(0, 1),
    "adam_b2": _in_half_open(0, 1),
    "adam_eps": _at_least(0),
    "adam_weight_decay": _at_least(0),
    "warmup_steps": _at_least(0),
    "dropout_rate": _in_half_open(0, 1),
    # 0 turns clipping off (the trainer reads it so); nan is refused as
    # every non-finite float is, so it cannot turn clipping off by accident.
    "gradient_clipping_threshold": _at_least(0),
    "normalization_layer_epsilon": _greater_than(0),
    "rope_min_timescale": _greater_than(0),
    "rope_max_timescale": _greater_than(0),
    "data_shuffle_seed": _seed,
    "init_weights_seed": _seed,
}
# Bytes of each supported dtype (the memory estimate).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# MaxText 0.2.5's `mesh_axes`, in its order, plus 'sequence' where older
# MaxText put it (its files still name it). The mesh has all of them; an axis
# is size 1 unless its key in MESH_AXIS_KEYS sets it.
MESH_AXES = ("diloco", "data", "stage", "fsdp", "fsdp_transpose", "sequence",
             "context", "context_usp_ulysses", "context_autoregressive",
             "tensor", "tensor_sequence", "expert", "autoregressive")
# MaxText's key for each axis's size: ici_<axis>_parallelism, except 'stage'.
MESH_AXIS_KEYS = {axis: f"ici_{axis}_parallelism" for axis in MESH_AXES}
MESH_AXIS_KEYS["stage"] = "ici_pipeline_parallelism"
# The one axis whose key may be -1, "the devices left over".
FILL_AXIS = "data"
# The axes whose product is this host's tensor-parallel size: both shard the
# weights' output features, and the activations between blocks on sequence.
TENSOR_AXES = ("tensor", "tensor_sequence")
# The model dimension (its config key) behind each logical axis of the host's
# model, so a rule sharding one over mesh axes that do not divide it is
# reported by key before anything is compiled. Heads are checked as counts:
# the fused [E, heads * head_dim] kernels must split at head boundaries.
LOGICAL_AXIS_DIMENSION_KEYS = {
    "activation_length": "max_target_length",
    "activation_heads": "base_num_query_heads",
    "heads": "base_num_query_heads",
    "activation_kv_heads": "base_num_kv_heads",
    "kv_heads": "base_num_kv_heads",
    "activation_mlp": "base_mlp_dim",
    "mlp": "base_mlp_dim",
    "activation_vocab": "vocab_size",
    "vocab": "vocab_size",
    "activation_embed": "base_emb_dim",
    "embed": "base_emb_dim",
    "norm": "base_emb_dim",
    "activation_kv": "head_dim",
    "kv": "head_dim",
}
# The logical axis of the batch dim; the trainer shards the input batch as
# its rule says.
BATCH_AXIS = "activation_batch"
# The logical axis of each fused layer's slot dim (see model.py).
FUSED_SLOT_AXES = {"fused_mlp": "num_activations", "fused_qkv": "qkv"}


def default_model_dir(base_config_path: str) -> str:
  """Model files live next to the base file, as in MaxText's configs/."""
  return os.path.dirname(os.path.abspath(base_config_path))


def _read_yaml(path: str, what: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    raise ConfigError(f"{what}: file not found: {path}")
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except UnicodeDecodeError as e:
    raise ConfigError(f"{what}: {path} is not a YAML text file (byte "
                      f"{e.start} is not UTF-8 text)") from None
  except OSError as e:
    raise ConfigError(f"{what}: cannot read {path}: "
                      f"{e.strerror or e}") from None
  if "\0" in text:
    raise ConfigError(f"{what}: {path} is not a YAML text file (it holds NUL "
                      "bytes)")
  try:
    data = yaml.safe_load(text)
  except yaml.YAMLError as e:
    where = getattr(e, "problem_mark", None)
    line = f" at line {where.line + 1}, column {where.column + 1}" if where \
        else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    raise ConfigError(f"{what}: {path} is not valid YAML{line}: "
                      f"{problem}") from None
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"{what}: {path} must hold a mapping of keys to values")
  odd = [key for key in data if not isinstance(key, str)]
  if odd:
    raise ConfigError(f"{what}: {path} has key {odd[0]!r}, not a name")
  return data


def _canonical_key(key: str) -> str:
  return KEY_ALIASES.get(key, key)


def _coerce(key: str, value: Any, default: Any, source: str) -> Any:
  """Checks `value` against the type of the base default (MaxText's rule)."""
  if key in _NULL_MEANS_DEFAULT and value is None:
    return default
  if default is None or value is None:
    return value
  if isinstance(value, str) and isinstance(default, (int, float)) and (
      not isinstance(default, bool)):
    # YAML 1.1 reads `1e-3` (no dot) as a string; MaxText converts by the
    # default's type.
    try:
      value = type(default)(value) if isinstance(default, float) else int(
          value)
    except ValueError:
      pass
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


def rule_mesh_axes(rule: Sequence[Any]) -> tuple[str, ...]:
  """The mesh axes a [logical_name, mesh axis | list | null] rule names."""
  target = rule[1]
  if target is None:
    return ()
  if isinstance(target, str):
    return (target,)
  return tuple(target)


def check_logical_axis_rules(rules: Sequence[Any], source: str) -> None:
  """Each rule is [logical_name, mesh axis or list of them or null], naming
  only axes of this host's mesh (MaxText's)."""
  for rule in rules:
    well_formed = (
        isinstance(rule, (list, tuple)) and len(rule) == 2
        and isinstance(rule[0], str)
        and (rule[1] is None or isinstance(rule[1], str)
             or (isinstance(rule[1], (list, tuple))
                 and all(isinstance(axis, str) for axis in rule[1]))))
    if not well_formed:
      raise ConfigError(f"logical_axis_rules (from {source}): bad rule "
                        f"{rule!r}; expected [logical_name, mesh_axis or list "
                        "or null]")
    for axis in rule_mesh_axes(rule):
      if axis not in MESH_AXES:
        raise ConfigError(
            f"logical_axis_rules (from {source}): rule {rule!r} names mesh "
            f"axis {axis!r}, not one of {list(MESH_AXES)}")


def merge_logical_axis_rules(rules: Sequence[Any], new_rules: Sequence[Any],
                             *, override: bool) -> list[Any]:
  """MaxText's merge of a later file's rules (pyconfig's
  `_merge_logical_axis_rules` / `_apply_rules`): `new_rules` replace every
  rule of `rules` with the same logical name and go after the others; with
  `override` (`override_logical_axis_rules` in the same file) they replace
  the whole list.

  A MaxText model file's rules are written as changes to MaxText's base
  rules (llama2-7b.yml sets only 'norm'); taken as the whole list they would
  leave every other logical axis unsharded.
  """
  if override:
    return list(new_rules)
  new_names = {rule[0] for rule in new_rules}
  return ([rule for rule in rules if rule[0] not in new_names]
          + list(new_rules))


def _apply(values: dict[str, Any], updates: Mapping[str, Any], source: str,
           defaults: Mapping[str, Any],
           sources: dict[str, str] | None = None) -> None:
  unknown = sorted(k for k in updates if _canonical_key(k) not in defaults)
  if unknown:
    hints = []
    for key in unknown:
      close = difflib.get_close_matches(key, list(defaults), n=3)
      if close:
        hints.append(f"{key}: did you mean {' or '.join(close)}?")
    raise ConfigError(
        f"unknown config key(s) {', '.join(unknown)} in {source} (every key "
        "must be defined in base.yml)" + ("; " + "; ".join(hints)
                                            if hints else ""))
  for key, value in updates.items():
    key = _canonical_key(key)
    value = _coerce(key, value, defaults[key], source)
    if key == "logical_axis_rules":
      check_logical_axis_rules(value, source)
      # As in MaxText, only the same file's (or command line's) flag decides
      # whether its rules replace the list so far.
      override = _coerce("override_logical_axis_rules",
                         updates.get("override_logical_axis_rules", False),
                         False, source)
      value = merge_logical_axis_rules(values[key], value, override=override)
    values[key] = value
    if sources is not None:
      sources[key] = source


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
  Device-dependent ones (`mesh_axis_sizes`, `data_parallelism`,
  `global_batch_size`) come from `resolve_for_devices`.
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
    """Shards of the tensor-parallel dims: the 'tensor' x 'tensor_sequence'
    mesh axes."""
    return math.prod(self[MESH_AXIS_KEYS[axis]] for axis in TENSOR_AXES)

  @property
  def checkpoint_directory(self) -> str:
    if self.checkpoint_dir:
      return os.path.abspath(self.checkpoint_dir)
    return os.path.abspath(os.path.join(
        self.base_output_directory, self.run_name, "checkpoints"))


def _check_value_ranges(values: Mapping[str, Any],
                        sources: Mapping[str, str]) -> None:
  """Every float finite, each VALUE_VALIDATORS key in its range, and each
  NOT_IMPLEMENTED_UNLESS key at its "off" value; errors name the key and
  where its value came from."""
  for key, value in values.items():
    if isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f"{key}={value!r} (from {_source(key, sources)}) "
                        "must be a finite number")
  for key, validate in VALUE_VALIDATORS.items():
    problem = validate(values[key])
    if problem:
      raise ConfigError(f"{key}={values[key]!r} (from "
                        f"{_source(key, sources)}) {problem}")
  for key, (required, feature) in NOT_IMPLEMENTED_UNLESS.items():
    if values[key] != required:
      raise ConfigError(
          f"{key}={values[key]!r} (from {_source(key, sources)}): the "
          f"reference host does not implement {feature}; only {key}="
          f"{required!r} is accepted")


def _source(key: str, sources: Mapping[str, str]) -> str:
  return sources.get(key, "the config")


def check_run_name(run_name: str, source: str = "the config") -> None:
  """`run_name` names a directory under base_output_directory: a single
  name, never a path (no '/', no '..', not absolute)."""
  separators = {"/", os.sep, os.altsep or "/"}
  if (any(sep in run_name for sep in separators) or run_name in (".", "..")
      or os.path.isabs(run_name) or "\0" in run_name):
    raise ConfigError(
        f"run_name={run_name!r} (from {source}) must be a name, not a path "
        "(no '/', '..' or absolute path): the run's directory is "
        "<base_output_directory>/<run_name>; set base_output_directory to "
        "choose where runs go")


def _check_model_name(model_name: Any, source: str, model_dir: str) -> None:
  """`model_name` names a model file in `model_dir`, never a path."""
  if not isinstance(model_name, str) or not model_name:
    raise ConfigError(f"model_name={model_name!r} (from {source}) must be "
                      "the name of a model file")
  separators = {"/", os.sep, os.altsep or "/"}
  if (any(sep in model_name for sep in separators)
      or model_name in (".", "..") or os.path.isabs(model_name)
      or "\0" in model_name):
    raise ConfigError(
        f"model_name={model_name!r} (from {source}) must name a model file "
        f"in {model_dir} (e.g. model_name=tiny), not a path; for a model file "
        "elsewhere, pass a base config next to it as the first argument "
        "(model files are looked up next to the base file)")


def _validate_values(values: Mapping[str, Any],
                     sources: Mapping[str, str] | None = None,
                     check_shardings: bool = True) -> None:
  sources = sources or {}
  _check_value_ranges(values, sources)
  check_run_name(values["run_name"], _source("run_name", sources))
  for key, allowed in SUPPORTED_VALUES.items():
    if values[key] not in allowed:
      raise ConfigError(
          f"{key}={values[key]!r} (from {_source(key, sources)}) is not "
          f"supported; expected one of {allowed}")
  for key, required in UNSUPPORTED_UNLESS.items():
    if values[key] != required:
      raise ConfigError(
          f"{key}={values[key]!r} (from {_source(key, sources)}) is not "
          f"supported by this llama-style host (only {required!r})")
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
      raise ConfigError(f"{key}={values[key]} (from {_source(key, sources)}) "
                        "must be positive")
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
  _check_mesh_keys(values)
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
  # The fill axis's size is not known yet; resolve_for_devices checks again.
  if not check_shardings:
    return
  _check_sharded_dimensions_divide(values, {
      axis: values[key] for axis, key in MESH_AXIS_KEYS.items()
      if values[key] != -1})


def _check_mesh_keys(values: Mapping[str, Any]) -> None:
  """Every mesh axis's key is a size >= 1; the fill axis's may be -1."""
  fill_key = MESH_AXIS_KEYS[FILL_AXIS]
  for key in MESH_AXIS_KEYS.values():
    if key == fill_key:
      if values[key] == 0 or values[key] < -1:
        raise ConfigError(f"{key}={values[key]} must be -1 (fill) or >= 1")
    elif values[key] < 1:
      raise ConfigError(f"{key}={values[key]} must be >= 1 (only {fill_key} "
                        "may be -1, the devices left over)")


def _first_rule_axes(rules: Sequence[Any], logical: str) -> tuple[str, ...]:
  """The mesh axes of the first rule for `logical`: the ones it is sharded
  over unless another dim of the same array already took them."""
  for rule in rules:
    if rule[0] == logical:
      return rule_mesh_axes(rule)
  return ()


def _mesh_keys_text(axes: Sequence[str], values: Mapping[str, Any],
                    axis_sizes: Mapping[str, int] | None = None) -> str:
  """'ici_tensor_parallelism=1 x ici_tensor_sequence_parallelism=4', with
  the size a -1 came to, when `axis_sizes` says it."""
  parts = []
  for axis in axes:
    key = MESH_AXIS_KEYS[axis]
    part = f"{key}={values[key]}"
    if values[key] == -1 and axis_sizes and axis in axis_sizes:
      part += f" ({axis_sizes[axis]} devices)"
    parts.append(part)
  return " x ".join(parts)


def _check_sharded_dimensions_divide(values: Mapping[str, Any],
                                     axis_sizes: Mapping[str, int]) -> None:
  """Each model dimension the rules shard splits evenly over its mesh axes
  (`axis_sizes`; an axis missing from it is not counted)."""
  for logical, key in LOGICAL_AXIS_DIMENSION_KEYS.items():
    axes = _first_rule_axes(values["logical_axis_rules"], logical)
    shards = math.prod(axis_sizes.get(axis, 1) for axis in axes)
    if values[key] % shards:
      raise ConfigError(
          f"{key}={values[key]} is not divisible by {shards}, the shards of "
          f"logical axis {logical!r}: logical_axis_rules maps it to mesh axes "
          f"{list(axes)} ({_mesh_keys_text(axes, values, axis_sizes)})")


def _check_mesh_axes_are_used(config: Config,
                              axis_sizes: Mapping[str, int]) -> None:
  """Every mesh axis of more than one device is named by some rule;
  otherwise its devices would all do the same work."""
  named = {axis for rule in config.logical_axis_rules
           for axis in rule_mesh_axes(rule)}
  for axis, size in axis_sizes.items():
    if size > 1 and axis not in named:
      key = MESH_AXIS_KEYS[axis]
      raise ConfigError(
          f"{key}={config[key]} gives mesh axis {axis!r} {size} devices, but "
          f"no logical_axis_rules entry names {axis!r}: those devices would "
          "repeat each other's work")


def _mesh_sizes_for_devices(config: Mapping[str, Any],
                            num_devices: int) -> dict[str, int]:
  """{axis: size} with the fill axis resolved; the mesh must use exactly
  the `num_devices` devices there are."""
  sizes = {axis: config[key] for axis, key in MESH_AXIS_KEYS.items()}
  fill_key = MESH_AXIS_KEYS[FILL_AXIS]
  set_axes = [axis for axis in MESH_AXES
              if axis != FILL_AXIS and sizes[axis] != 1]
  others = math.prod(sizes[axis] for axis in set_axes)
  if sizes[FILL_AXIS] == -1:
    if num_devices % others:
      raise ConfigError(
          f"{_mesh_keys_text(set_axes, config)} ({others} devices) does not "
          f"divide the {num_devices} devices ({fill_key}=-1 takes the rest)")
    sizes[FILL_AXIS] = num_devices // others
  if math.prod(sizes.values()) != num_devices:
    raise ConfigError(
        f"the mesh {_mesh_keys_text([FILL_AXIS, *set_axes], config)} has "
        f"{math.prod(sizes.values())} devices, not the {num_devices} devices "
        "there are (every other ici_*_parallelism key is 1)")
  return sizes


def resolve_for_devices(config: Config, num_devices: int) -> Config:
  """Fills the mesh sizes for `num_devices` and checks the batch divides.

  Returns a config with `mesh_axis_sizes` ({axis: size} over MESH_AXES),
  `data_parallelism` and `global_batch_size` set.
  """
  sizes = _mesh_sizes_for_devices(config, num_devices)
  _check_sharded_dimensions_divide(config.to_dict(), sizes)
  _check_mesh_axes_are_used(config, sizes)

  global_batch = config.per_device_batch_size * num_devices
  if not math.isclose(global_batch, round(global_batch)) or global_batch < 1:
    raise ConfigError(
        f"per_device_batch_size={config.per_device_batch_size} x "
        f"{num_devices} devices = {global_batch} is not a whole batch")
  global_batch = int(round(global_batch))
  batch_axes = _first_rule_axes(config.logical_axis_rules, BATCH_AXIS)
  batch_shards = math.prod(sizes[axis] for axis in batch_axes)
  if global_batch % batch_shards:
    raise ConfigError(
        f"per_device_batch_size={config.per_device_batch_size} gives a global "
        f"batch of {global_batch}, not divisible by its {batch_shards} shards "
        f"({_mesh_keys_text(batch_axes, config, sizes)}: the mesh axes "
        f"logical_axis_rules maps {BATCH_AXIS!r} to)")
  return config.replace(mesh_axis_sizes=sizes, data_parallelism=sizes["data"],
                        global_batch_size=global_batch)


def estimate_memory_bytes(config: Config, num_params: int) -> dict[str, int]:
  """A lower bound of the memory one train step of `config` (resolved for
  its devices) holds over all of them, in bytes: 'state' (parameters,
  gradients and Adam's two moments, each `num_params` x weight_dtype),
  'activations' (each layer's input and normed input per token, and the
  float32 logits and their gradient) and 'total'."""
  state = 4 * num_params * DTYPE_BYTES[config.weight_dtype]
  tokens = config.global_batch_size * config.max_target_length
  activations = tokens * (
      2 * config.num_decoder_layers * config.emb_dim
      * DTYPE_BYTES[config.dtype] + 2 * config.vocab_size * 4)
  return {"state": state, "activations": activations,
          "total": state + activations}


def check_fits_memory(config: Config, num_params: int, available_bytes: int,
                      where: str) -> None:
  """Refuses, in one line, a model whose memory estimate (a lower bound,
  `estimate_memory_bytes`) exceeds `available_bytes`, the memory of `where`
  (e.g. "8 cpu devices sharing 23.4 GiB of host memory")."""
  estimate = estimate_memory_bytes(config, num_params)
  if estimate["total"] <= available_bytes:
    return
  gib = lambda n: f"{n / 2**30:,.1f} GiB"  # pylint: disable=unnecessary-lambda-assignment
  raise ConfigError(
      f"the model does not fit: it needs at least {gib(estimate['total'])} "
      f"({num_params:,} parameters x {DTYPE_BYTES[config.weight_dtype]} bytes"
      f" x 4 for parameters, gradients and Adam's moments = "
      f"{gib(estimate['state'])}, plus {gib(estimate['activations'])} of "
      f"activations), more than {where}; base_emb_dim="
      f"{config.base_emb_dim}, base_mlp_dim={config.base_mlp_dim}, "
      f"base_num_decoder_layers={config.base_num_decoder_layers}, "
      f"vocab_size={config.vocab_size}, global batch "
      f"{config.global_batch_size} x max_target_length="
      f"{config.max_target_length}")


def load_config(argv: Sequence[str], *, model_dir: str | None = None,
                num_devices: int | None = None,
                check_shardings: bool = True) -> Config:
  """Loads `argv = [base.yml, key=value, ...]` MaxText-style.

  Args:
    argv: the base config path, then key=value overrides (`model_name=NAME`
      pulls `<model_dir>/NAME.yml` between the base and the overrides).
    model_dir: where model files live; default: the base file's directory.
    num_devices: when given, also resolves and checks the mesh and batch.
    check_shardings: check that the mesh axes' sizes divide the dimensions
      the rules shard. False: leave that to a later call with `num_devices`
      (which checks it after the mesh), so that a mesh larger than the
      machine is reported as such.
  """
  if not argv:
    raise ConfigError("expected a config file as the first argument")
  base_path, *override_args = argv
  defaults = _read_yaml(base_path, "base config")
  missing = [key for key in BASE_ONLY_KEYS if key not in defaults]
  if missing:
    stem = os.path.splitext(os.path.basename(base_path))[0]
    base = os.path.join(os.path.dirname(base_path) or ".", "base.yml")
    raise ConfigError(
        f"{base_path} is not a base config (it has no {', '.join(missing)}); "
        "a model file is chosen with model_name on top of the base file: "
        f"{base} model_name={stem} " + " ".join(override_args))
  if "logical_axis_rules" in defaults:
    check_logical_axis_rules(defaults["logical_axis_rules"], base_path)
  values = dict(defaults)
  sources = {key: base_path for key in defaults}
  overrides = parse_overrides(override_args)

  # The model file applies before command-line overrides, so `model_name`
  # from the command line or from the base file selects it.
  model_name = overrides.get("model_name", values.get("model_name", "default"))
  if model_name != "default":
    model_dir = model_dir or default_model_dir(base_path)
    _check_model_name(model_name, "command-line overrides"
                      if "model_name" in overrides else base_path, model_dir)
    model_path = os.path.join(model_dir, f"{model_name}.yml")
    if not os.path.isfile(model_path):
      available = sorted(
          f[:-4] for f in os.listdir(model_dir)
          if f.endswith(".yml") and f != os.path.basename(base_path))
      raise ConfigError(
          f"model_name={model_name!r}: no model file {model_path} "
          f"(available: {', '.join(available)})")
    _apply(values, _read_yaml(model_path, f"model_name={model_name}"),
           model_path, defaults, sources)
  _apply(values, overrides, "command-line overrides", defaults, sources)
  if num_devices is not None:  # Mesh errors before what they cause.
    _check_mesh_keys(values)
    _mesh_sizes_for_devices(values, num_devices)
  _validate_values(values, sources, check_shardings)
  config = Config(values)
  if num_devices is not None:
    config = resolve_for_devices(config, num_devices)
  return config
