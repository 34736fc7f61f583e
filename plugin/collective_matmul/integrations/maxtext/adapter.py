"""Routes MaxText's dense projections through the collective matmul.

MaxText's layers take no `dot_general` argument: every unquantized
projection goes through `maxtext.layers.linears._compute_dot_general_nnx`,
called from `DenseGeneral.__call__`, which knows only the kernel's logical
axes. `install()` wraps those two private names, and the `__call__` of the
modules that own the projections (`MlpBlock`, `Attention` and its
`compute_shared_kv`, the decoder's output head, MoE blocks and their router
gate, whose routed experts and gate are left alone (a MoE block's shared
experts are an MlpBlock, served as any), and the models' own owners: gpt3's
attention, gemma4_small's decoder layer and per-layer embedder, qwen3-next's
Gated DeltaNet and MoE block, qwen3-custom's decoder layer), so that at
trace time the dot_general of a known projection in a training graph
becomes `collective_matmul.logical_dot_general` with the activation's and
result's logical axes from `projections.PROJECTIONS`; so does the output
head's tied-embedding logits (`attend_on_embedding`). Everything else takes
MaxText's own code, and the decision record says why, a MoE block's routed
experts and the test layers' own matmuls included (recorded when the block
or layer is called). Sibling projections of one activation (Attention's
query/key/value in self-attention, MlpBlock's wi_0/wi_1) run as one grouped
collective matmul at the first one's dot (`_sibling_group`); the later ones'
dots are served its results. A projection of `quantization=fp8` (Flax's
`Fp8DirectDotGeneralOp` in a `ToNNX`, MaxText's `quant_dot_general`) runs
`fp8.Fp8DirectDotGeneralOp` on the same variables, alone (each has its own
scales), and so does one of Qwix's `fp8_gpu` (`quantization.py`, which also
patches `quantizations._apply_linen_module_in_nnx`); Qwix's other modes and
other quantizers keep MaxText's path, with the mode or the quantizer's class
in the reason. Nothing is patched at parameter creation, so the
parameter tree, initial values and checkpoints are MaxText's; with the
plugin off (the configuration read at trace time) every call is MaxText's
original function, so the program is bit-identical to stock MaxText.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import inspect
import os
import threading
from typing import Any, Callable, Iterator

from absl import logging
import jax
from jax import lax
import jax.numpy as jnp

from collective_matmul import config as config_lib
from collective_matmul import grouping
from collective_matmul import override
from collective_matmul import record
from collective_matmul.integrations.maxtext import attention
from collective_matmul.integrations.maxtext import projections
from collective_matmul.integrations.maxtext import quantization

# Versions whose private names this adapter was written against and tested
# with (tests/integrations/maxtext). Others are refused, not guessed at,
# unless the user allows an untested one (MaxText from source): then every
# signature check must still pass.
SUPPORTED_MAXTEXT_VERSIONS = ("0.2.5",)
# `install(allow_untested_version=None)` reads this environment variable
# ("1" allows); the launcher's --maxtext_allow_untested_version sets it.
ALLOW_UNTESTED_ENV = "CM_MAXTEXT_ALLOW_UNTESTED_VERSION"

# The parameters of each patched private name in MaxText 0.2.5: exactly
# these (the adapter calls them with all of them), or at least these.
_EXPECTED_PARAMETERS = (
    ("linears", "_compute_dot_general_nnx", "exactly", (
        "inputs", "kernel", "axis", "contract_ind", "matmul_precision",
        "quant_dot_general", "initializing", "out_sharding", "kernel_scale",
        "compute_dtype", "native_fp8_compute", "scale_block_size",
        "act_calibration_method")),
    ("linears", "DenseGeneral.__call__", "exactly", (
        "self", "inputs", "_initializing", "out_sharding", "slice_bounds")),
    ("linears", "MlpBlock.__init__", "at least", ("model_mode",)),
    ("attentions", "Attention.__call__", "at least", (
        "inputs_q", "inputs_kv", "model_mode", "shared_key",
        "shared_value")),
    # Multi-head latent attention (deepseek), an Attention with its own
    # __call__: its out projection is Attention's.
    ("attention_mla", "MLA.__call__", "at least", (
        "inputs_q", "inputs_kv", "model_mode")),
    # A donor layer's shared key/value (gemma4_small), and its layers' loop,
    # called with model_mode sixth.
    ("attentions", "Attention.compute_shared_kv", "at least", (
        "self", "inputs_kv")),
    ("nnx_decoders", "NNXDecoder._apply_gemma4_small_layers", "at least", (
        "self", "y", "decoder_input_tokens", "decoder_segment_ids",
        "decoder_positions", "deterministic", "model_mode")),
    ("nnx_decoders", "NNXDecoder.apply_output_head", "exactly", (
        "self", "shared_embedding", "y", "deterministic", "model_mode",
        "normalize_y")),
    # The tied-embedding logits (logits_via_embedding).
    ("nnx_decoders", "attend_on_embedding", "exactly", (
        "query", "embedding_table", "attend_dtype", "config",
        "out_sharding")),
    # Recorded, left to MaxText: the router gate and the routed experts.
    ("moe", "GateLogit.__call__", "at least", ("self", "inputs")),
    ("moe", "RoutedMoE.__call__", "at least", ("self", "inputs")),
    # `attention` (--maxtext_shard_gpu_attention).
    ("attention_op", "AttentionOp.apply_attention", "at least", (
        "self", "query", "key", "value", "decoder_segment_ids",
        "model_mode")),
    ("attention_op", "tokamax_pallas_triton.PallasTritonFlashAttention",
     "at least", ()),
    # Qwix's fp8_gpu: the ToNNX of Flax's fp8 op on a DenseGeneral.
    ("quantizations", "_apply_linen_module_in_nnx", "exactly", (
        "linen_module_cls", "op_id", "args", "kwargs")),
)
_TRAIN = "train"  # maxtext.common.common_types.MODEL_MODE_TRAIN
# The decoder's output head with logits_via_embedding: the token embedding
# table, [vocab, embed_vocab] (`Embed.embedding`), contracted on embed.
_TIED_LOGITS = "decoder/logits_via_embedding"
# A RoutedMoE's expert weights, [experts, in, out] (`prefuse_moe_weights`:
# wi holds wi_0 and wi_1).
_EXPERT_WEIGHTS = ("wi_0", "wi_1", "wi", "wo")
# MaxText's test decoder layers (`maxtext.models.simple_layer`, decoder_block
# simple / simple_mlp): their weights, in the order jnp.dot chains them.
_OWN_MATMUL_LAYERS = {"SimpleDecoderLayer": ("weights",),
                      "SimpleMlpDecoderLayer": ("ff_1", "ff_2")}
# The DenseGeneral attributes of an owner that project the same activation,
# in the order MaxText 0.2.5 calls them: the first one's dot runs the group.
_SIBLINGS = {"attention": ("query", "key", "value"), "mlp": ("wi_0", "wi_1")}


class MaxTextVersionError(RuntimeError):
  """The installed MaxText is not one this adapter knows how to patch."""


@dataclasses.dataclass
class _Frame:
  # "mlp", "attention", "decoder", "moe", "gate", "layer" (gemma4_small's
  # decoder layer, which owns projections itself), "qwen3_custom_layer",
  # "linear_attention" (qwen3-next's Gated DeltaNet), "shared_moe"
  # (qwen3-next's MoE block with its shared expert), "per_layer_embedder"
  # (gemma4_small's per-layer inputs) or "dense".
  kind: str
  module: Any
  model_mode: str | None = None
  # The first part of the names of the projections it owns (default: the
  # kind). "layer": named only when it is the innermost owner.
  label: str = ""
  # "dense": the array DenseGeneral was called with.
  inputs: Any = None
  # "attention": called with inputs_q is inputs_kv and no shared key/value,
  # so query, key and value project the same array.
  self_attention: bool = False
  # Owners: results of a sibling group for the later siblings' dots, by
  # attribute name: (result, the call it was computed for, the array the
  # first sibling's DenseGeneral was called with).
  group_results: dict[str, tuple[Any, "_Captured", Any]] = (
      dataclasses.field(default_factory=dict))
  group_reason: str = ""  # Owners: why the siblings were not grouped.

  @property
  def prefix(self) -> str:
    return self.label or self.kind


_local = threading.local()
_originals: dict[tuple[Any, str], Callable] = {}


def _stack() -> list[_Frame]:
  if not hasattr(_local, "stack"):
    _local.stack = []
  return _local.stack


@contextlib.contextmanager
def _entered(frame: _Frame) -> Iterator[None]:
  stack = _stack()
  stack.append(frame)
  try:
    yield
  finally:
    stack.pop()


def _maxtext_modules():
  from maxtext.layers import attention_mla  # pylint: disable=g-import-not-at-top
  from maxtext.layers import attention_op  # pylint: disable=g-import-not-at-top
  from maxtext.layers import attentions  # pylint: disable=g-import-not-at-top
  from maxtext.layers import linears  # pylint: disable=g-import-not-at-top
  from maxtext.layers import moe  # pylint: disable=g-import-not-at-top
  from maxtext.layers import nnx_decoders  # pylint: disable=g-import-not-at-top
  from maxtext.layers import quantizations  # pylint: disable=g-import-not-at-top
  return (linears, attentions, moe, nnx_decoders, attention_op, attention_mla,
          quantizations)


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
  modules = dict(zip(("linears", "attentions", "moe", "nnx_decoders",
                      "attention_op", "attention_mla", "quantizations"),
                     _maxtext_modules()))
  for module_name, path, how, expected in _EXPECTED_PARAMETERS:
    target = modules[module_name]
    for attr in path.split("."):
      target = getattr(target, attr, None)
    if target is None:
      raise MaxTextVersionError(f"MaxText {version} has no "
                                f"{module_name}.{path}")
    target = inspect.unwrap(target)  # Ours, if installed already.
    if not expected:  # Only its presence.
      continue
    names = tuple(inspect.signature(target).parameters)
    fits = (names == expected if how == "exactly"
            else set(expected) <= set(names))
    if not fits:
      raise MaxTextVersionError(
          f"MaxText {version}: {module_name}.{path} has parameters {names}, "
          f"the adapter expects {how} {expected}")
  if untested:
    logging.warning(
        "collective matmul: MaxText %s is untested (tested: %s); allowed by "
        "--maxtext_allow_untested_version / %s, and the signatures of the "
        "private functions it patches match. Compare its losses with the "
        "plugin off (scripts/maxtext_ab.py) before trusting it.", version,
        tested, ALLOW_UNTESTED_ENV)
  return version


def _patch(owner, attr, make_wrapper) -> None:
  original = getattr(owner, attr)
  _originals[(owner, attr)] = original
  setattr(owner, attr, make_wrapper(original))


def is_installed() -> bool:
  return bool(_originals)


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
  (linears, attentions, moe, nnx_decoders, _, attention_mla,
   quantizations) = _maxtext_modules()
  attention.install()

  def owner_call(kind, mode_of, details=lambda args, kwargs: {}, label=""):
    def make(original):
      def call(self, *args, **kwargs):
        with _entered(_Frame(kind, self, mode_of(self, args, kwargs),
                             label=label, **details(args, kwargs))):
          return original(self, *args, **kwargs)
      call.__wrapped__ = original
      return call
    return make

  def argument(args, kwargs, index, name):
    return args[index] if len(args) > index else kwargs.get(name)

  def attention_details(args, kwargs):
    same = (argument(args, kwargs, 0, "inputs_q") is
            argument(args, kwargs, 1, "inputs_kv"))
    shared = (kwargs.get("shared_key") is not None or
              kwargs.get("shared_value") is not None)
    return {"self_attention": same and not shared}

  _patch(linears.MlpBlock, "__call__", owner_call(
      "mlp", lambda self, a, kw: _mlp_model_mode(self)))
  for attention_class in (attentions.Attention, attention_mla.MLA):
    _patch(attention_class, "__call__", owner_call(
        "attention", lambda self, a, kw: kw.get("model_mode", _TRAIN),
        attention_details))
  # A donor layer's key/value for the layers that share them (gemma4_small):
  # Attention's projections, called outside its __call__.
  _patch(attentions.Attention, "compute_shared_kv", owner_call(
      "attention", lambda self, a, kw: getattr(self, "model_mode", _TRAIN)))
  # gemma4_small's decoder layer owns its per-layer input projections; the
  # per-layer inputs themselves come from one projection of the embeddings.
  from maxtext.models import gemma4_small  # pylint: disable=g-import-not-at-top
  _patch(gemma4_small.Gemma4SmallDecoderLayer, "__call__", owner_call(
      "layer", lambda self, a, kw: argument(a, kw, 4, "model_mode") or (
          getattr(self, "model_mode", None) or _TRAIN)))
  _patch(gemma4_small.Gemma4SmallPLE, "__call__", owner_call(
      "per_layer_embedder",
      lambda self, a, kw: getattr(_local, "decoder_mode", None)))
  _patch(nnx_decoders.NNXDecoder, "_apply_gemma4_small_layers",
         _make_decoder_mode_call)
  # qwen3-next (and qwen3.5): the Gated DeltaNet's projections, and the MoE
  # block's gate of its shared expert.
  from maxtext.models import qwen3  # pylint: disable=g-import-not-at-top
  _patch(qwen3.Qwen3NextGatedDeltaNet, "__call__", owner_call(
      "linear_attention",
      lambda self, a, kw: argument(a, kw, 1, "model_mode") or _TRAIN))
  _patch(qwen3.Qwen3NextSparseMoeBlock, "__call__", owner_call(
      "shared_moe", lambda self, a, kw: None, label="moe"))
  # qwen3-custom's decoder layer: its up projection after the experts.
  from maxtext.models import qwen3_custom  # pylint: disable=g-import-not-at-top
  _patch(qwen3_custom.Qwen3CustomMoeDecoderLayer, "__call__", owner_call(
      "qwen3_custom_layer",
      lambda self, a, kw: argument(a, kw, 4, "model_mode") or _TRAIN,
      label="layer"))
  # gpt3's own attention class: one input, always self-attention.
  from maxtext.models import gpt3  # pylint: disable=g-import-not-at-top
  _patch(gpt3.Gpt3MultiHeadAttention, "__call__", owner_call(
      "attention", lambda self, a, kw: kw.get("model_mode", _TRAIN),
      lambda args, kwargs: {"self_attention": True}))
  _patch(nnx_decoders.NNXDecoder, "apply_output_head", owner_call(
      "decoder",
      lambda self, a, kw: argument(a, kw, 3, "model_mode") or _TRAIN))
  _patch(moe.RoutedMoE, "__call__", _make_routed_moe_call)
  if hasattr(moe, "RoutedAndSharedMoE"):
    _patch(moe.RoutedAndSharedMoE, "__call__", owner_call(
        "moe", lambda self, a, kw: None))
  _patch(moe.GateLogit, "__call__", owner_call(
      "gate", lambda self, a, kw: None))
  _patch(nnx_decoders, "attend_on_embedding", _make_attend_on_embedding)
  from maxtext.models import simple_layer  # pylint: disable=g-import-not-at-top
  for layer, weights in _OWN_MATMUL_LAYERS.items():
    if hasattr(simple_layer, layer):
      _patch(getattr(simple_layer, layer), "__call__",
             functools.partial(_make_own_matmul_layer_call, weights=weights))
  _patch(linears.DenseGeneral, "__call__", owner_call(
      "dense", lambda self, a, kw: None,
      lambda args, kw: {"inputs": argument(args, kw, 0, "inputs")}))
  _patch(linears, "_compute_dot_general_nnx", _make_dot_general_nnx)
  _patch(quantizations, "_apply_linen_module_in_nnx",
         quantization.make_apply_linen_module_in_nnx)
  return version


def _mlp_model_mode(mlp_block) -> str:
  """An MlpBlock's model mode; one built without (RoutedAndSharedMoE's
  shared experts): MaxText's model_call_mode ("inference" under vLLM), which
  qwen3-next's shared expert is built with, and "" is training."""
  return (getattr(mlp_block, "model_mode", None) or
          getattr(getattr(mlp_block, "config", None), "model_call_mode",
                  None) or _TRAIN)


def uninstall() -> None:
  """Restores MaxText's own functions."""
  attention.uninstall()
  for (owner, attr), original in reversed(list(_originals.items())):
    setattr(owner, attr, original)
  _originals.clear()


def _attribute_name(owner, module) -> str | None:
  return next((k for k, v in getattr(owner, "__dict__", {}).items()
               if v is module), None)


def _projection_name(owners, module) -> str | None:
  """`module`'s name: the outermost owner's kind, the attribute of each
  nested owner of another kind in the one around it, and `module`'s
  attribute in the innermost ("mlp/wi_0"; a mixture-of-experts block's
  shared experts: "moe/shared_experts/wi_0"); None when the innermost owner
  does not hold it."""
  # A decoder layer names only the projections it owns itself.
  owners = [f for f in owners[:-1] if f.prefix != "layer"] + owners[-1:]
  if not owners:
    return None
  parts = [owners[0].prefix]
  for outer, inner in zip(owners, owners[1:]):
    if inner.prefix != outer.prefix:
      parts.append(_attribute_name(outer.module, inner.module) or inner.kind)
  attr = _attribute_name(owners[-1].module, module)
  return "/".join(parts + [attr]) if attr else None


def _qwix_mode(stack) -> quantization.QwixMode | None:
  """The Qwix quantization of the innermost module's dot_general, or None;
  its owners' MaxText config names the mode."""
  return quantization.qwix_mode(
      getattr(f.module, "config", None) for f in reversed(stack))


def _not_served_reason(stack, inputs, kernel, quant_dot_general, kernel_scale,
                       native_fp8_compute, qwix=None):
  """(reason or None, projection, name) for the innermost DenseGeneral;
  `qwix`: its `_qwix_mode`."""
  dense = stack[-1].module
  kernel_axes = tuple(getattr(dense, "kernel_axes", ()) or ())
  owners = [f for f in stack[:-1] if f.kind != "dense"]
  owner = owners[-1] if owners else None
  name = _projection_name(owners, dense) or f"dense{kernel_axes}"
  if quant_dot_general is not None and _flax_fp8_op(quant_dot_general) is None:
    wrapped = getattr(quant_dot_general, "to_nnx__module", quant_dot_general)
    return (f"quantized (quant config: {type(wrapped).__name__})", None,
            name)
  if (kernel_scale is not None or native_fp8_compute or
      "float8" in str(getattr(kernel, "dtype", ""))):
    return "fp8 weights", None, name
  if qwix is not None and not qwix.served:
    return f"quantized: {qwix.left_reason}", None, name
  if "EXPLICIT" in str(getattr(dense, "shard_mode", "")).upper():
    return ("shard_mode=explicit (the adapter serves MaxText's logical, "
            "Auto-sharded route)"), None, name
  # A mixture-of-experts block (RoutedAndSharedMoE) holds its shared
  # experts, an MlpBlock: served as every MlpBlock where its weights are the
  # dense pattern; anything else in it is left.
  in_moe = any(f.kind == "moe" for f in owners)
  if in_moe and (owner is None or owner.kind != "mlp"):
    return "inside a mixture-of-experts block", None, name
  if owner is None:
    return (f"kernel axes {kernel_axes}: not a projection of an MlpBlock, "
            "Attention or the decoder's output head"), None, name
  if owner.prefix == "layer" and _attribute_name(owner.module, dense) is None:
    return (f"kernel axes {kernel_axes}: inside a decoder layer, not one of "
            "its own projections"), None, name
  projection = projections.find_projection(owner.kind, kernel_axes)
  if (owner.kind, kernel_axes) in projections.RULES_UNSHARDED:
    return _rules_unsharded_reason(
        kernel_axes, *projections.RULES_UNSHARDED[owner.kind, kernel_axes]
    ), None, name
  if projection is None:
    reason = projections.LEFT.get(
        (owner.kind, kernel_axes),
        f"kernel axes {kernel_axes} are not a known {owner.kind} "
        "projection")
    if in_moe:
      reason = ("the shared experts of a mixture-of-experts block "
                f"(RoutedAndSharedMoE's MlpBlock): {reason}")
    return reason, None, name
  if owner.model_mode != _TRAIN:
    return (f"model_mode={owner.model_mode!r} (the adapter serves "
            "training)"), None, name
  if jnp.ndim(inputs) != len(projection.activation_axes):
    return (f"activation of rank {jnp.ndim(inputs)}, expected "
            f"{projection.activation_axes}"), None, name
  return None, projection, name


def _rules_unsharded_reason(kernel_axes, what, dim, role) -> str:
  """Why `projections.RULES_UNSHARDED`'s projection is left: which rule
  leaves its kernel's dimension `dim` without a mesh axis (the active
  Flax logical axis rules, MaxText's)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  spec = tuple(nn.logical_to_mesh_axes(kernel_axes))
  name = kernel_axes[dim]
  collective = ("all-gather" if role == "output" else "reduce-scatter")
  if spec[dim] is not None:
    return (f"{what}: not served (tested only with MaxText's default rules, "
            f"which give its kernel's '{name}' no mesh axis); these rules "
            f"shard it over {spec[dim]}")
  as_tuple = lambda e: () if e is None else (e,) if isinstance(e, str) else (
      tuple(e))
  wanted = [as_tuple(axes) for logical, axes in nn.get_logical_axis_rules()
            if logical == name]
  taken = {axis: kernel_axes[d] for d, entry in enumerate(spec)
           for axis in as_tuple(entry)}
  clash = sorted({(axis, taken[axis]) for axes in wanted for axis in axes
                  if axis in taken})
  why = ", ".join(f"'{axis}', which '{other}' took first" for axis, other
                  in clash) or "none of them"
  return (f"{what}: MaxText's logical_axis_rules give its kernel's {role} "
          f"features ('{name}') no mesh axis (its rule also lists {why}, and "
          "Flax then skips the rule), so the weight is replicated over "
          f"tensor_sequence: no {collective} to overlap")


def _flax_fp8_op(quant_dot_general):
  """The Flax `Fp8DirectDotGeneralOp` that MaxText's `quantization=fp8`
  wraps in a `ToNNX` as a projection's `quant_dot_general`, or None (other
  quantization modes, and Flax's other fp8 ops, keep MaxText's path)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  module = getattr(quant_dot_general, "to_nnx__module", None)
  return module if type(module) is nn.Fp8DirectDotGeneralOp else None


def _served_fp8(quant_dot_general, call, projection, name):
  """MaxText's fp8 projection through `fp8.Fp8DirectDotGeneralOp`: the
  `ToNNX` that holds Flax's op (its variables) runs ours, with the same
  fields and variables, for `call()` (MaxText's call of it)."""
  from collective_matmul import fp8  # pylint: disable=g-import-not-at-top
  flax_op = _flax_fp8_op(quant_dot_general)
  ours = fp8.Fp8DirectDotGeneralOp(
      amax_history_length=flax_op.amax_history_length,
      e4m3_dtype=flax_op.e4m3_dtype, e5m2_dtype=flax_op.e5m2_dtype,
      lhs_axes=projection.activation_axes, rhs_axes=projection.kernel_axes,
      out_axes=projection.out_axes, result_axes=projection.result_axes,
      record_name=name, parent=None)
  # `to_nnx__module` is static data of the ToNNX, not state: swapped for
  # the call, past nnx's attribute checks, and put back.
  object.__setattr__(quant_dot_general, "to_nnx__module", ours)
  try:
    return call()
  finally:
    object.__setattr__(quant_dot_general, "to_nnx__module", flax_op)


def _served_fp8_gpu(dense_general, maxtext_path, projection, name):
  """Qwix's fp8_gpu projection: MaxText's path, in which Qwix's provider
  finds the DenseGeneral's ToNNX of Flax's fp8 op, which runs ours
  (`_served_fp8`) as `quantization=fp8`'s does."""
  def serve(to_nnx, args):
    return _served_fp8(to_nnx, functools.partial(
        to_nnx, *args, **quantization.fp8_gpu_call_kwargs()), projection,
                       name)
  with quantization.serving_fp8_gpu(dense_general, serve):
    return maxtext_path()


def _make_dot_general_nnx(original):
  def dot_general_nnx(inputs, kernel, axis, contract_ind, matmul_precision,
                      quant_dot_general, initializing, out_sharding=None,
                      kernel_scale=None, compute_dtype=None,
                      native_fp8_compute=False, scale_block_size=None,
                      act_calibration_method="absmax"):
    def maxtext_path():
      return original(inputs, kernel, axis, contract_ind, matmul_precision,
                      quant_dot_general, initializing, out_sharding,
                      kernel_scale=kernel_scale, compute_dtype=compute_dtype,
                      native_fp8_compute=native_fp8_compute,
                      scale_block_size=scale_block_size,
                      act_calibration_method=act_calibration_method)

    stack = _stack()
    captured = getattr(_local, "captured", None)
    if captured is not None:  # `_capture_call`: note the call, stand in.
      qwix = _qwix_mode(stack)
      reason, projection, name = _not_served_reason(
          stack, inputs, kernel, quant_dot_general, kernel_scale,
          native_fp8_compute, qwix)
      if reason is None and qwix is not None:
        reason = "Qwix fp8_gpu, served alone with its own fp8 scales"
      captured.append(_Captured(
          inputs, kernel, tuple(axis), tuple(contract_ind), matmul_precision,
          reason, projection, name))
      result = jax.eval_shape(functools.partial(
          lax.dot_general, dimension_numbers=captured[-1].dimension_numbers),
          inputs, kernel)
      return jnp.zeros(result.shape, result.dtype)
    # `initializing`: a quantized layer's construction calls it once on a
    # dummy input to create the quantizer's variables; no step runs it.
    if not config_lib.get_config().enabled or initializing or not stack:
      return maxtext_path()
    if stack[-1].kind == "gate":  # GateLogit calls it without a DenseGeneral.
      _record_gate(stack, inputs, kernel)
      return maxtext_path()
    if stack[-1].kind != "dense":
      return maxtext_path()
    qwix = _qwix_mode(stack)
    reason, projection, name = _not_served_reason(
        stack, inputs, kernel, quant_dot_general, kernel_scale,
        native_fp8_compute, qwix)
    if reason is not None:
      record.record_not_served(
          name, f"left to MaxText: {reason}", lhs_shape=jnp.shape(inputs),
          rhs_shape=jnp.shape(kernel),
          dtype=qwix.dtype if qwix else jnp.result_type(inputs))
      return maxtext_path()
    call = _Captured(inputs, kernel, tuple(axis), tuple(contract_ind),
                     matmul_precision, None, projection, name)
    if quant_dot_general is not None:  # Flax's fp8 op: each its own scales.
      return _served_fp8(quant_dot_general, functools.partial(
          quant_dot_general, inputs, kernel, call.dimension_numbers,
          precision=None, mutable=["aqt"]), projection, name)
    if qwix is not None:  # Qwix's fp8_gpu: Flax's fp8 op, as above.
      return _served_fp8_gpu(stack[-1].module, maxtext_path, projection,
                             name)
    result, group_reason = _sibling_group(stack, call)
    if result is not None:
      return result
    return override.collective_dot_general(
        inputs, kernel, call.dimension_numbers,
        lax.Precision(matmul_precision),
        lhs_axes=projection.activation_axes, rhs_axes=projection.kernel_axes,
        out_axes=projection.out_axes, name=name, group_reason=group_reason)

  dot_general_nnx.__wrapped__ = original
  return dot_general_nnx


# ----------------------------------- mixture of experts, tied-embedding logits


def _record_gate(stack, inputs, kernel) -> None:
  """Records a MoE router gate (`GateLogit`) as left to MaxText."""
  gate = stack[-1].module
  owners = [f for f in stack[:-1] if f.kind not in ("dense", "gate")]
  kernel_axes = tuple(getattr(gate, "kernel_axes", ()) or ())
  outputs = kernel_axes[len(getattr(gate, "in_features_shape", (0,))):]
  if outputs and all(axis is None for axis in outputs):
    reason = (f"the router gate's kernel {kernel_axes} leaves its experts "
              "dimension unsharded: each device computes its own rows' "
              "logits, no all-gather to overlap")
  else:
    reason = (f"the router gate (kernel axes {kernel_axes}) is not a "
              "projection the adapter serves")
  record.record_not_served(
      _projection_name(owners, gate) or "moe/gate",
      f"left to MaxText: {reason}", lhs_shape=jnp.shape(inputs),
      rhs_shape=jnp.shape(kernel), dtype=jnp.result_type(inputs))


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


def _make_routed_moe_call(original):
  def call(self, inputs, *args, **kwargs):
    with _entered(_Frame("moe", self)):
      if config_lib.get_config().enabled:
        owners = [f for f in _stack() if f.kind != "dense"]
        reason = _routed_experts_reason(getattr(self, "config", None))
        for attr in _EXPERT_WEIGHTS:
          weight = getattr(self, attr, None)
          if weight is None:
            continue
          weight = weight.get_value() if hasattr(weight, "get_value") else (
              weight)
          record.record_not_served(
              _projection_name(owners, getattr(self, attr)) or f"moe/{attr}",
              f"left to MaxText: {reason}", lhs_shape=jnp.shape(inputs),
              rhs_shape=jnp.shape(weight), dtype=jnp.result_type(inputs))
      return original(self, inputs, *args, **kwargs)
  call.__wrapped__ = original
  return call


def _make_decoder_mode_call(original):
  """gemma4_small's layers: their model mode, for the per-layer inputs'
  projection (`Gemma4SmallPLE` takes none)."""
  def call(self, *args, **kwargs):
    mode = args[5] if len(args) > 5 else kwargs.get("model_mode")
    previous = getattr(_local, "decoder_mode", None)
    _local.decoder_mode = mode
    try:
      return original(self, *args, **kwargs)
    finally:
      _local.decoder_mode = previous
  call.__wrapped__ = original
  return call


def _make_own_matmul_layer_call(original, weights):
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


def _make_attend_on_embedding(original):
  """The decoder's tied-embedding logits: `jnp.dot(query, bf16(table).T,
  preferred_element_type=attend_dtype)` as a collective matmul of the
  table [vocab, embed_vocab] contracted on its second dimension."""
  def attend_on_embedding(query, embedding_table, attend_dtype, config,
                          out_sharding=None):
    def maxtext_path():
      return original(query, embedding_table, attend_dtype, config,
                      out_sharding)

    stack = _stack()
    if (not config_lib.get_config().enabled or not stack or
        stack[-1].kind != "decoder"):
      return maxtext_path()
    table_shape = jnp.shape(embedding_table)
    reason = None
    qwix = _qwix_mode(stack)
    if qwix is not None:
      reason = "quantized: " + (qwix.left_reason or (
          "Qwix fp8_gpu on the tied-embedding logits (its fp8 is served on "
          "DenseGeneral projections only)"))
    elif "EXPLICIT" in str(getattr(config, "shard_mode", "")).upper():
      reason = ("shard_mode=explicit (the adapter serves MaxText's logical, "
                "Auto-sharded route)")
    elif stack[-1].model_mode != _TRAIN:
      reason = (f"model_mode={stack[-1].model_mode!r} (the adapter serves "
                "training)")
    elif jnp.ndim(query) != len(projections.LOGITS_INPUT):
      reason = (f"activation of rank {jnp.ndim(query)}, expected "
                f"{projections.LOGITS_INPUT}")
    elif getattr(config, "parameter_memory_host_offload", False):
      reason = "the embedding table is offloaded to host memory"
    if reason is not None:
      record.record_not_served(
          _TIED_LOGITS, f"left to MaxText: {reason}",
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
        rhs_axes=projection.kernel_axes, name=_TIED_LOGITS)

  attend_on_embedding.__wrapped__ = original
  return attend_on_embedding


# ------------------------------------------------------- sibling projections


@dataclasses.dataclass(frozen=True)
class _Captured:
  """One DenseGeneral's call of `_compute_dot_general_nnx`, as MaxText made
  it, and what the adapter makes of it (`_not_served_reason`)."""

  inputs: Any
  kernel: Any
  axis: tuple[int, ...]
  contract_ind: tuple[int, ...]
  matmul_precision: Any
  reason: str | None
  projection: projections.Projection | None
  name: str

  @property
  def dimension_numbers(self):
    return (self.axis, self.contract_ind), ((), ())

  def signature(self):
    """What a served call must share with the call the group computed."""
    return (self.dimension_numbers, self.matmul_precision,
            jnp.shape(self.inputs), jnp.result_type(self.inputs),
            jnp.shape(self.kernel), jnp.result_type(self.kernel))


def _sibling_group(stack, call: _Captured):
  """(result, "") when the innermost DenseGeneral's `call` is served by its
  siblings' group; else (None, why its siblings were not grouped, or "" when
  it has none).

  The first sibling's dot runs the group and keeps the later ones' results
  in the owner's frame; a later sibling's dot takes its result when its
  call is the one the group computed, on the same input.
  """
  dense = stack[-1]
  owner = next((f for f in reversed(stack[:-1]) if f.kind != "dense"), None)
  siblings = _present_siblings(owner)
  attr = _attribute_name(owner.module, dense.module) if siblings else None
  if attr not in siblings:
    return None, ""
  if attr in owner.group_results:
    result, planned, group_input = owner.group_results.pop(attr)
    if call.signature() != planned.signature():
      return None, "its dot_general is not the one the group computed"
    if dense.inputs is group_input:
      return result, ""
    # Attention.__call__ (MaxText 0.2.5, pinned by SUPPORTED_MAXTEXT_
    # VERSIONS) passes inputs_q and inputs_kv, here one array, through the
    # same sharding constraint (`_maybe_shard_with_logical(x,
    # input_axis_names)`) straight to the projections: equal values in two
    # tracers.
    if (owner.kind == "attention" and owner.self_attention and
        jnp.shape(dense.inputs) == jnp.shape(group_input) and
        jnp.result_type(dense.inputs) == jnp.result_type(group_input)):
      return result, ""
    return None, "its input is not provably the group's"
  if attr != siblings[0]:
    return None, owner.group_reason
  result, owner.group_reason = _run_sibling_group(owner, dense, siblings,
                                                  call)
  return result, owner.group_reason


def _present_siblings(owner) -> tuple[str, ...]:
  """The owner's sibling DenseGenerals that exist (MaxText drops `value`
  with share_kv_projections, and key/value with share_kv_layer)."""
  if owner is None or owner.kind not in _SIBLINGS:
    return ()
  linears = _maxtext_modules()[0]
  present = tuple(a for a in _SIBLINGS[owner.kind] if isinstance(
      getattr(owner.module, a, None), linears.DenseGeneral))
  return present if len(present) > 1 else ()


def _run_sibling_group(owner, dense, siblings, call: _Captured):
  """At the first sibling's dot: (its result, "") from one grouped
  collective matmul, the later siblings' results kept in `owner`; or (None,
  why not)."""
  if not config_lib.get_config().group_siblings:
    return None, grouping.GROUPING_OFF
  if owner.kind == "attention" and not owner.self_attention:
    return None, ("query and key/value project different arrays (not "
                  "self-attention, or a shared key/value)")
  calls = [call]
  for attr in siblings[1:]:
    sibling, why = _capture_call(getattr(owner.module, attr), dense.inputs)
    if why is not None:
      return None, f"{owner.kind}/{attr}: {why}"
    if sibling.reason is not None:
      return None, f"{sibling.name} is left to MaxText ({sibling.reason})"
    if (sibling.projection.activation_axes, sibling.dimension_numbers,
        sibling.matmul_precision) != (call.projection.activation_axes,
                                      call.dimension_numbers,
                                      call.matmul_precision):
      return None, f"{sibling.name} contracts another way than {call.name}"
    if (jnp.shape(sibling.inputs), jnp.result_type(sibling.inputs)) != (
        jnp.shape(call.inputs), jnp.result_type(call.inputs)):
      return None, f"{sibling.name} casts the input to another dtype"
    calls.append(sibling)
  results = grouping.grouped_logical_dot_general(
      call.inputs, [(c.kernel, c.projection.kernel_axes, c.name)
                    for c in calls],
      call.dimension_numbers, lax.Precision(call.matmul_precision),
      lhs_axes=call.projection.activation_axes)
  for attr, sibling, result in zip(siblings[1:], calls[1:], results[1:]):
    owner.group_results[attr] = (result, sibling, dense.inputs)
  return results[0], ""


def _capture_call(dense_general, inputs):
  """(the `_Captured` call MaxText's own `DenseGeneral.__call__` makes on
  `inputs`, None), or (None, why not).

  The sibling's kernel is then exactly what its own call will contract with
  (read, cast and gathered by MaxText's code); the stand-in result of this
  call is discarded, and jit drops it.
  """
  _local.captured = captured = []
  try:
    dense_general(inputs)
  except (TypeError, ValueError) as e:
    return None, f"does not take the same input ({e})"
  finally:
    _local.captured = None
  if len(captured) != 1:
    return None, f"made {len(captured)} dot_generals, expected 1"
  return captured[0], None
