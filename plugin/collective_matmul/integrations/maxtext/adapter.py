"""Routes MaxText's dense projections through the collective matmul.

MaxText's layers take no `dot_general` argument: every unquantized
projection goes through `maxtext.layers.linears._compute_dot_general_nnx`,
called from `DenseGeneral.__call__`, which knows only the kernel's logical
axes. `install()` wraps the MaxText names in `PATCHES`, each checked
against the parameters the adapter reads or calls with first: the owners of
the projections push their frames (`owners`, `frames`), and at trace time
the dot_general of a known projection in a training graph becomes a
collective matmul (`dense`), with its siblings grouped (`siblings`) and
fp8 on MaxText's own fp8 state (`quantization=fp8`, Qwix's `fp8_gpu`:
`quantization`); so does the output head's tied-embedding logits
(`owners.make_attend_on_embedding`). Everything else takes MaxText's own
code, and the decision record says why. Nothing is patched at parameter
creation, so the parameter tree, initial values and checkpoints are
MaxText's; with the plugin off (the configuration read at trace time) every
call is MaxText's original function, so the program is bit-identical to
stock MaxText. `--maxtext_shard_gpu_attention`'s patches are
`attention.py`'s, listed here too.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import os
from typing import Any, Callable

from absl import logging

from collective_matmul.integrations.maxtext import attention
from collective_matmul.integrations.maxtext import dense
from collective_matmul.integrations.maxtext import frames
from collective_matmul.integrations.maxtext import owners
from collective_matmul.integrations.maxtext import quantization

# Versions whose private names this adapter was written against and tested
# with (tests/integrations/maxtext). Others are refused, not guessed at,
# unless the user allows an untested one (MaxText from source): then every
# signature check must still pass.
SUPPORTED_MAXTEXT_VERSIONS = ("0.2.5",)
# `install(allow_untested_version=None)` reads this environment variable
# ("1" allows); the launcher's --maxtext_allow_untested_version sets it.
ALLOW_UNTESTED_ENV = "CM_MAXTEXT_ALLOW_UNTESTED_VERSION"

# What `Patch.make` is for a name `attention.install()` patches.
BY_ATTENTION = "attention.install"
_MODULES = {"linears": "maxtext.layers.linears",
            "qwix_dot_general_qt": "qwix._src.core.dot_general_qt",
            "attentions": "maxtext.layers.attentions",
            "attention_mla": "maxtext.layers.attention_mla",
            "attention_op": "maxtext.layers.attention_op",
            "moe": "maxtext.layers.moe",
            "nnx_decoders": "maxtext.layers.nnx_decoders",
            "quantizations": "maxtext.layers.quantizations",
            "gemma4_small": "maxtext.models.gemma4_small",
            "gpt3": "maxtext.models.gpt3",
            "qwen3": "maxtext.models.qwen3",
            "qwen3_custom": "maxtext.models.qwen3_custom",
            "simple_layer": "maxtext.models.simple_layer"}


class MaxTextVersionError(RuntimeError):
  """The installed MaxText is not one this adapter knows how to patch."""


@dataclasses.dataclass(frozen=True)
class Patch:
  """One MaxText name the adapter patches (or reads), and its check.

  module: a key of `_MODULES`; path: the name in it ("Class.method").
  how, parameters: the name's parameters in MaxText 0.2.5 are "exactly"
    these (the adapter calls it with all of them) or "at least" these (the
    ones it reads); () checks only that the name is there.
  make: the wrapper factory (`make(original)`), `BY_ATTENTION`, or None
    for a name only read.
  """

  module: str
  path: str
  how: str
  parameters: tuple[str, ...]
  make: Callable[[Callable], Callable] | str | None = None

  @property
  def name(self) -> str:
    return f"{self.module}.{self.path}"

  def owner(self) -> tuple[Any, str]:
    """(the object holding the name, its last attribute)."""
    owner = importlib.import_module(_MODULES[self.module])
    *outer, attr = self.path.split(".")
    for part in outer:
      owner = getattr(owner, part, None)
    return owner, attr


_TRAIN = frames.TRAIN
_none = lambda self, arguments: None  # pylint: disable=unnecessary-lambda-assignment
_attention = owners.owner_call(
    "attention", lambda self, arguments: arguments.get("model_mode", _TRAIN),
    owners.attention_details)
_OWN_MATMULS = owners.OWN_MATMUL_LAYERS
PATCHES = (
    # Every unquantized projection's matmul, and the DenseGeneral calling it.
    Patch("linears", "_compute_dot_general_nnx", "exactly", (
        "inputs", "kernel", "axis", "contract_ind", "matmul_precision",
        "quant_dot_general", "initializing", "out_sharding", "kernel_scale",
        "compute_dtype", "native_fp8_compute", "scale_block_size",
        "act_calibration_method"), dense.make_dot_general_nnx),
    Patch("linears", "DenseGeneral.__call__", "exactly", (
        "self", "inputs", "_initializing", "out_sharding", "slice_bounds"),
          owners.owner_call("dense", _none, lambda arguments: {
              "inputs": arguments.get("inputs")})),
    # Owners: MlpBlock (its model mode set at construction), Attention and
    # multi-head latent attention (deepseek, its own __call__), a donor
    # layer's shared key/value (gemma4_small: Attention's projections,
    # called outside its __call__).
    Patch("linears", "MlpBlock.__init__", "at least", ("model_mode",)),
    Patch("linears", "MlpBlock.__call__", "at least", ("self", "inputs"),
          owners.owner_call("mlp", lambda self, arguments: (
              owners.mlp_model_mode(self)))),
    Patch("attentions", "Attention.__call__", "at least", (
        "inputs_q", "inputs_kv", "model_mode", "shared_key",
        "shared_value"), _attention),
    Patch("attention_mla", "MLA.__call__", "at least", (
        "inputs_q", "inputs_kv", "model_mode"), _attention),
    Patch("attentions", "Attention.compute_shared_kv", "at least", (
        "self", "inputs_kv"), owners.owner_call(
            "attention", lambda self, arguments: getattr(
                self, "model_mode", _TRAIN))),
    # gemma4_small's decoder layer owns its per-layer input projections; the
    # per-layer inputs come from one projection of the embeddings, in the
    # mode of the layers' loop.
    Patch("gemma4_small", "Gemma4SmallDecoderLayer.__call__", "at least", (
        "self", "inputs", "model_mode"), owners.owner_call(
            "layer", owners.model_mode_or_train)),
    Patch("gemma4_small", "Gemma4SmallPLE.__call__", "at least", (
        "self", "input_ids"), owners.owner_call(
            "per_layer_embedder", lambda self, arguments: getattr(
                frames.local, "decoder_mode", None))),
    Patch("nnx_decoders", "NNXDecoder._apply_gemma4_small_layers",
          "at least", ("self", "y", "decoder_input_tokens",
                       "decoder_segment_ids", "decoder_positions",
                       "deterministic", "model_mode"),
          owners.make_decoder_mode_call),
    # qwen3-next (and qwen3.5): the Gated DeltaNet's projections, and the
    # MoE block's gate of its shared expert; qwen3-custom's decoder layer:
    # its up projection after the experts.
    Patch("qwen3", "Qwen3NextGatedDeltaNet.__call__", "at least", (
        "self", "hidden_states", "model_mode"), owners.owner_call(
            "linear_attention", lambda self, arguments: (
                arguments.get("model_mode") or _TRAIN))),
    Patch("qwen3", "Qwen3NextSparseMoeBlock.__call__", "at least", (
        "self", "hidden_states"), owners.owner_call(
            "shared_moe", _none, label="moe")),
    Patch("qwen3_custom", "Qwen3CustomMoeDecoderLayer.__call__", "at least",
          ("self", "inputs", "model_mode"), owners.owner_call(
              "qwen3_custom_layer", lambda self, arguments: (
                  arguments.get("model_mode") or _TRAIN), label="layer")),
    # gpt3's own attention class: one input, always self-attention.
    Patch("gpt3", "Gpt3MultiHeadAttention.__call__", "at least", (
        "self", "inputs_q", "model_mode"), owners.owner_call(
            "attention", lambda self, arguments: arguments.get(
                "model_mode", _TRAIN),
            lambda arguments: {"self_attention": True})),
    # The decoder's output head, and its tied-embedding logits
    # (logits_via_embedding).
    Patch("nnx_decoders", "NNXDecoder.apply_output_head", "exactly", (
        "self", "shared_embedding", "y", "deterministic", "model_mode",
        "normalize_y"), owners.owner_call(
            "decoder", lambda self, arguments: (
                arguments.get("model_mode") or _TRAIN))),
    Patch("nnx_decoders", "attend_on_embedding", "exactly", (
        "query", "embedding_table", "attend_dtype", "config",
        "out_sharding"), owners.make_attend_on_embedding),
    # Recorded, left to MaxText: the routed experts and the router gate; a
    # MoE block with shared experts (an MlpBlock, served as any).
    Patch("moe", "RoutedMoE.__call__", "at least", ("self", "inputs"),
          owners.make_routed_moe_call),
    Patch("moe", "RoutedAndSharedMoE.__call__", "at least",
          ("self", "inputs"), owners.owner_call("moe", _none)),
    Patch("moe", "GateLogit.__call__", "at least", ("self", "inputs"),
          owners.owner_call("gate", _none)),
    # Recorded, left to MaxText: the test decoder layers' own jnp.dot.
    *(Patch("simple_layer", f"{layer}.__call__", "at least",
            ("self", "inputs"), functools.partial(
                owners.make_own_matmul_layer_call, weights=weights))
      for layer, weights in _OWN_MATMULS.items()),
    # Qwix's fp8_gpu: the ToNNX of Flax's fp8 op on a DenseGeneral.
    Patch("quantizations", "_apply_linen_module_in_nnx", "exactly", (
        "linen_module_cls", "op_id", "args", "kwargs"),
          quantization.make_apply_linen_module_in_nnx),
    # Qwix's fp8_full / fp8 / fp8_e4m3 / fp8_e5m2: its provider's call.
    Patch("qwix_dot_general_qt", "dot_general_qt", "exactly", (
        "lhs", "rhs", "dimension_numbers", "config"),
          quantization.make_dot_general_qt),
    # `attention` (--maxtext_shard_gpu_attention).
    Patch("attention_op", "AttentionOp.apply_attention", "at least", (
        "self", "query", "key", "value", "decoder_segment_ids",
        "model_mode"), BY_ATTENTION),
    Patch("attention_op", "tokamax_pallas_triton.PallasTritonFlashAttention",
          "at least", (), BY_ATTENTION),
)

_originals: dict[tuple[Any, str], Callable] = {}
_patched: list[str] = []  # Their `Patch.name`s.


def allow_untested_from_environment() -> bool:
  """Whether `ALLOW_UNTESTED_ENV` allows an untested MaxText version."""
  value = os.environ.get(ALLOW_UNTESTED_ENV, "").strip().lower()
  return value in ("1", "true", "yes")


def check_maxtext(allow_untested_version: bool | None = None) -> str:
  """The installed MaxText version, after checking it can be patched.

  Args:
    allow_untested_version: proceed with a version not in
      `SUPPORTED_MAXTEXT_VERSIONS` (e.g. MaxText installed from git) when
      every patched private name has the parameters the adapter expects;
      one warning names the tested versions. None: `ALLOW_UNTESTED_ENV`.

  Raises:
    MaxTextVersionError: MaxText is missing, its version is not supported
      (and not allowed), or a patched private function's signature changed.
  """
  if allow_untested_version is None:
    allow_untested_version = allow_untested_from_environment()
  try:
    version = importlib.metadata.version("maxtext")
  except importlib.metadata.PackageNotFoundError as e:
    raise MaxTextVersionError(
        "MaxText is not installed: pip install 'collective-matmul[maxtext]' "
        "(Python >= 3.12)") from e
  tested = ", ".join(SUPPORTED_MAXTEXT_VERSIONS)
  untested = version not in SUPPORTED_MAXTEXT_VERSIONS
  if untested and not allow_untested_version:
    raise MaxTextVersionError(
        f"MaxText {version} is not supported by collective_matmul's MaxText "
        f"adapter (tested: {tested}): it patches private MaxText functions "
        "whose signatures it must know. To try it at your own risk (e.g. "
        "MaxText from source), pass --maxtext_allow_untested_version to the "
        f"launcher or set {ALLOW_UNTESTED_ENV}=1; the signatures are still "
        "checked")
  for row in PATCHES:
    owner, attr = row.owner()
    target = getattr(owner, attr, None) if owner is not None else None
    if target is None:
      raise MaxTextVersionError(f"MaxText {version} has no {row.name}")
    target = inspect.unwrap(target)  # Ours, if installed already.
    if not row.parameters:  # Only its presence.
      continue
    names = tuple(inspect.signature(target).parameters)
    fits = (names == row.parameters if row.how == "exactly"
            else set(row.parameters) <= set(names))
    if not fits:
      raise MaxTextVersionError(
          f"MaxText {version}: {row.name} has parameters {names}, the "
          f"adapter expects {row.how} {row.parameters}")
  if untested:
    logging.warning(
        "collective matmul: MaxText %s is untested (tested: %s); allowed by "
        "--maxtext_allow_untested_version / %s, and the signatures of the "
        "private functions it patches match. Compare its losses with the "
        "plugin off (scripts/maxtext_ab.py) before trusting it.", version,
        tested, ALLOW_UNTESTED_ENV)
  return version


def is_installed() -> bool:
  return bool(_originals)


def patched_names() -> tuple[str, ...]:
  """The MaxText names patched now, as `Patch.name` spells them."""
  return tuple(_patched) + attention.patched_names()


def install(allow_untested_version: bool | None = None) -> str:
  """Routes MaxText's dense projections through the plugin; idempotent.

  The plugin's configuration (`--use_collective_matmul` once absl parsed the
  flags, or `set_config` / `config_context`) is read when MaxText's step is
  traced: with it off, MaxText runs its own code.

  Args:
    allow_untested_version: see `check_maxtext` (None: the environment).

  Returns:
    The MaxText version patched.

  Raises:
    MaxTextVersionError: see `check_maxtext`.
  """
  version = check_maxtext(allow_untested_version)
  if is_installed():
    return version
  attention.install()
  for row in PATCHES:
    if callable(row.make):
      owner, attr = row.owner()
      original = getattr(owner, attr)
      _originals[(owner, attr)] = original
      _patched.append(row.name)
      setattr(owner, attr, row.make(original))
  return version


def uninstall() -> None:
  """Restores MaxText's own functions."""
  attention.uninstall()
  for (owner, attr), original in reversed(list(_originals.items())):
    setattr(owner, attr, original)
  _originals.clear()
  _patched.clear()
