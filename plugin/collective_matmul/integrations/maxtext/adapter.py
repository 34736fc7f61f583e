"""Routes MaxText's dense projections through the collective matmul.

MaxText's layers take no `dot_general` argument: every unquantized
projection goes through `maxtext.layers.linears._compute_dot_general_nnx`,
called from `DenseGeneral.__call__`, which knows only the kernel's logical
axes. `install()` wraps those two private names, and the `__call__` of the
modules that own the projections (`MlpBlock`, `Attention`, and MoE blocks,
which are left alone), so that at trace time the dot_general of a known
projection in a training graph becomes `collective_matmul.
logical_dot_general` with the activation's and result's logical axes from
`projections.PROJECTIONS`. Everything else takes MaxText's own code, and the
decision record says why. Nothing is patched at parameter creation, so the
parameter tree, initial values and checkpoints are MaxText's; with the
plugin off (the configuration read at trace time) every call is MaxText's
original function, so the program is bit-identical to stock MaxText.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import inspect
import threading
from typing import Any, Callable, Iterator

from jax import lax
import jax.numpy as jnp

from collective_matmul import config as config_lib
from collective_matmul import override
from collective_matmul.integrations.maxtext import projections

# Versions whose private names this adapter was written against and tested
# with (tests/integrations/maxtext). Others are refused, not guessed at.
SUPPORTED_MAXTEXT_VERSIONS = ("0.2.5",)

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
    ("attentions", "Attention.__call__", "at least", ("model_mode",)),
)
_TRAIN = "train"  # maxtext.common.common_types.MODEL_MODE_TRAIN


class MaxTextVersionError(RuntimeError):
  """The installed MaxText is not one this adapter knows how to patch."""


@dataclasses.dataclass
class _Frame:
  kind: str  # "mlp", "attention", "moe" or "dense".
  module: Any
  model_mode: str | None = None


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
  from maxtext.layers import attentions  # pylint: disable=g-import-not-at-top
  from maxtext.layers import linears  # pylint: disable=g-import-not-at-top
  from maxtext.layers import moe  # pylint: disable=g-import-not-at-top
  return linears, attentions, moe


def check_maxtext() -> str:
  """The installed MaxText version, after checking it can be patched.

  Raises:
    MaxTextVersionError: MaxText is missing, its version is not supported,
      or a patched private function's signature changed.
  """
  try:
    version = importlib.metadata.version("maxtext")
  except importlib.metadata.PackageNotFoundError as e:
    raise MaxTextVersionError(
        "MaxText is not installed: pip install 'collective-matmul[maxtext]' "
        "(Python >= 3.12)") from e
  if version not in SUPPORTED_MAXTEXT_VERSIONS:
    raise MaxTextVersionError(
        f"MaxText {version} is not supported by collective_matmul's MaxText "
        f"adapter (supported: {', '.join(SUPPORTED_MAXTEXT_VERSIONS)}): it "
        "patches private MaxText functions whose signatures it must know")
  modules = dict(zip(("linears", "attentions", "moe"), _maxtext_modules()))
  for module_name, path, how, expected in _EXPECTED_PARAMETERS:
    target = modules[module_name]
    for attr in path.split("."):
      target = getattr(target, attr, None)
    if target is None:
      raise MaxTextVersionError(f"MaxText {version} has no "
                                f"{module_name}.{path}")
    target = inspect.unwrap(target)  # Ours, if installed already.
    names = tuple(inspect.signature(target).parameters)
    fits = (names == expected if how == "exactly"
            else set(expected) <= set(names))
    if not fits:
      raise MaxTextVersionError(
          f"MaxText {version}: {module_name}.{path} has parameters {names}, "
          f"the adapter expects {how} {expected}")
  return version


def _patch(owner, attr, make_wrapper) -> None:
  original = getattr(owner, attr)
  _originals[(owner, attr)] = original
  setattr(owner, attr, make_wrapper(original))


def is_installed() -> bool:
  return bool(_originals)


def install() -> str:
  """Routes MaxText's dense projections through the plugin; idempotent.

  The plugin's configuration (`--use_collective_matmul` once absl parsed the
  flags, or `set_config` / `config_context`) is read when MaxText's step is
  traced: with it off, MaxText runs its own code.

  Returns:
    The MaxText version patched.

  Raises:
    MaxTextVersionError: see `check_maxtext`.
  """
  version = check_maxtext()
  if is_installed():
    return version
  linears, attentions, moe = _maxtext_modules()

  def owner_call(kind, mode_of):
    def make(original):
      def call(self, *args, **kwargs):
        with _entered(_Frame(kind, self, mode_of(self, kwargs))):
          return original(self, *args, **kwargs)
      call.__wrapped__ = original
      return call
    return make

  _patch(linears.MlpBlock, "__call__", owner_call(
      "mlp", lambda self, kw: getattr(self, "model_mode", None) or _TRAIN))
  _patch(attentions.Attention, "__call__", owner_call(
      "attention", lambda self, kw: kw.get("model_mode", _TRAIN)))
  for name in ("RoutedMoE", "RoutedAndSharedMoE"):
    if hasattr(moe, name):
      _patch(getattr(moe, name), "__call__", owner_call(
          "moe", lambda self, kw: None))
  _patch(linears.DenseGeneral, "__call__", owner_call(
      "dense", lambda self, kw: None))
  _patch(linears, "_compute_dot_general_nnx", _make_dot_general_nnx)
  return version


def uninstall() -> None:
  """Restores MaxText's own functions."""
  for (owner, attr), original in reversed(list(_originals.items())):
    setattr(owner, attr, original)
  _originals.clear()


def _attribute_name(owner, module) -> str | None:
  return next((k for k, v in vars(owner).items() if v is module), None)


def _not_served_reason(stack, inputs, kernel, quant_dot_general, kernel_scale,
                       native_fp8_compute):
  """(reason or None, projection, name) for the innermost DenseGeneral."""
  dense = stack[-1].module
  kernel_axes = tuple(getattr(dense, "kernel_axes", ()) or ())
  owners = [f for f in stack[:-1] if f.kind != "dense"]
  owner = owners[-1] if owners else None
  attr = _attribute_name(owner.module, dense) if owner else None
  name = f"{owner.kind}/{attr}" if owner and attr else f"dense{kernel_axes}"
  if quant_dot_general is not None:
    return "quantized (quant config)", None, name
  if (kernel_scale is not None or native_fp8_compute or
      "float8" in str(getattr(kernel, "dtype", ""))):
    return "fp8 weights", None, name
  if "EXPLICIT" in str(getattr(dense, "shard_mode", "")).upper():
    return ("shard_mode=explicit (the adapter serves MaxText's logical, "
            "Auto-sharded route)"), None, name
  if any(f.kind == "moe" for f in owners):
    return "inside a mixture-of-experts block", None, name
  if owner is None:
    return (f"kernel axes {kernel_axes}: not a projection of an MlpBlock or "
            "Attention"), None, name
  if owner.model_mode != _TRAIN:
    return (f"model_mode={owner.model_mode!r} (the adapter serves "
            "training)"), None, name
  projection = projections.find_projection(owner.kind, kernel_axes)
  if projection is None:
    return (f"kernel axes {kernel_axes} are not a known {owner.kind} "
            "projection"), None, name
  if jnp.ndim(inputs) != len(projection.activation_axes):
    return (f"activation of rank {jnp.ndim(inputs)}, expected "
            f"{projection.activation_axes}"), None, name
  return None, projection, name


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
    if (not config_lib.get_config().enabled or not stack or
        stack[-1].kind != "dense"):
      return maxtext_path()
    reason, projection, name = _not_served_reason(
        stack, inputs, kernel, quant_dot_general, kernel_scale,
        native_fp8_compute)
    if reason is not None:
      override.record_not_served(
          name, f"left to MaxText: {reason}", lhs_shape=jnp.shape(inputs),
          rhs_shape=jnp.shape(kernel), dtype=jnp.result_type(inputs))
      return maxtext_path()
    dot_general = override.logical_dot_general(
        projection.activation_axes, projection.kernel_axes,
        out_axes=projection.out_axes, name=name)
    return dot_general(inputs, kernel, ((tuple(axis), tuple(contract_ind)),
                                        ((), ())),
                       precision=lax.Precision(matmul_precision))

  dot_general_nnx.__wrapped__ = original
  return dot_general_nnx
