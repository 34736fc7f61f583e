"""MaxText's GPU flash attention, run per shard of batch and heads.

MaxText 0.2.5's GPU flash path (`AttentionOp.apply_attention` with
`attention=flash`, or `autoselected` on GPU in training) calls tokamax's
`PallasTritonFlashAttention` with no sharding. XLA cannot partition a Triton
custom call, so on a mesh that shards heads (`tensor`, `tensor_sequence`) it
all-gathers q, k and v whole onto every device, and every device computes
every head, forward and backward, then keeps its own slice.

tokamax can run the same kernel in a `shard_map` over batch and heads
(`q_sharding` / `k_sharding`). With `--maxtext_shard_gpu_attention`, this
module passes them, built from the op's mesh and MaxText's logical axis rules
(the axes MaxText itself constrains q, k and v to). The kernel, its inputs per
head and so the numerics are the same; what changes is that each device
computes only its own heads, and q, k and v are not gathered.

It applies only where the sharding is plain: no sequence or head_dim
sharding (context parallelism keeps MaxText's call), heads and batch
divisible by their mesh axes. Every call records what was done or why not
(`notes()`), and the launcher prints them. Off (the default), MaxText's own
call runs, untouched.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable

from absl import flags
import jax

from collective_matmul import patterns

_SHARD = flags.DEFINE_bool(
    "maxtext_shard_gpu_attention", False,
    "MaxText only: run the GPU flash attention (tokamax's Triton kernel) per "
    "shard of batch and heads instead of gathering q/k/v onto every device, "
    "where every device computes every head. Independent of "
    "--use_collective_matmul.")

# AttentionOp.attention_kernel values that take the GPU flash path, and the
# model mode that does not (maxtext.common.common_types).
_FLASH = ("flash", "autoselected")
_AUTOREGRESSIVE = "autoregressive"

_local = threading.local()
_notes: list[str] = []
_enabled_in_code: bool | None = None
_originals: dict[str, Any] = {}


def set_enabled(enabled: bool | None) -> None:
  """Switches the sharded attention on/off in code (wins over the flag);
  None: the flag decides again."""
  global _enabled_in_code
  _enabled_in_code = enabled


def enabled() -> bool:
  if _enabled_in_code is not None:
    return _enabled_in_code
  return flags.FLAGS.is_parsed() and _SHARD.value


def notes() -> list[str]:
  """What each traced GPU flash attention call did, in trace order."""
  return list(_notes)


def _note(text: str) -> None:
  _notes.append(text)


def _entry(axes: tuple[str, ...]):
  """A `patterns.normalize_spec` entry back as a PartitionSpec entry (and as
  the reasons name it): None, one axis name, or a tuple of them."""
  return None if not axes else axes[0] if len(axes) == 1 else axes


def shardings(mesh, q_spec, k_spec, q_shape, k_shape):
  """(q_sharding, k_sharding, "") for tokamax's [batch, seq, heads, head_dim]
  q and k, or (None, None, why MaxText's own call is kept).

  q_spec, k_spec: PartitionSpecs MaxText's rules give q and k in that layout.
  """
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  if len(q_shape) != 4 or len(k_shape) != 4:
    return None, None, f"q of rank {len(q_shape)}, k of rank {len(k_shape)}"
  try:
    q_axes = patterns.normalize_spec(q_spec, 4)
    k_axes = patterns.normalize_spec(k_spec, 4)
  except ValueError as e:
    return None, None, str(e)
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  for name, axes in (("q", q_axes), ("k", k_axes)):
    if size(axes[1]) > 1:
      return None, None, (f"{name}'s sequence is sharded over "
                          f"{_entry(axes[1])} (context parallelism)")
    if size(axes[3]) > 1:
      return None, None, (f"{name}'s head_dim is sharded over "
                          f"{_entry(axes[3])}")
  if q_axes[0] != k_axes[0]:
    return None, None, (f"q and k batch shardings differ "
                        f"({_entry(q_axes[0])} vs {_entry(k_axes[0])})")
  for name, shape, axes in (("q", q_shape, q_axes), ("k", k_shape, k_axes)):
    for dim, label in ((0, "batch"), (2, "heads")):
      if shape[dim] % size(axes[dim]):
        return None, None, (f"{name}'s {shape[dim]} {label} do not divide "
                            f"over {_entry(axes[dim])} ({size(axes[dim])} "
                            "devices)")
  if size(q_axes[0]) * size(q_axes[2]) == 1:
    return None, None, "neither batch nor heads is sharded: nothing to split"
  q_sharding = NamedSharding(
      mesh, P(_entry(q_axes[0]), None, _entry(q_axes[2]), None))
  k_sharding = NamedSharding(
      mesh, P(_entry(k_axes[0]), None, _entry(k_axes[2]), None))
  return q_sharding, k_sharding, ""


def _plan(attention_op, query, key):
  """`shardings` for the AttentionOp being applied and its q, k."""
  from maxtext.common import common_types as ct  # pylint: disable=g-import-not-at-top
  logical = attention_op._logical_to_mesh_axes  # pylint: disable=protected-access
  q_spec = logical((ct.BATCH_ATTN, ct.LENGTH, ct.HEAD, ct.D_KV))
  k_spec = logical((ct.BATCH_ATTN, ct.KV_LENGTH, ct.HEAD, ct.D_KV))
  return shardings(attention_op.mesh, q_spec, k_spec, query.shape,
                   getattr(key, "shape", ()))


class _ShardedOp:
  """Stands in for a tokamax attention op: calls it with the q/k shardings
  planned for the AttentionOp being applied (`apply_attention` below) when
  switched on; off, calls it as MaxText did and notes what it would do."""

  def __init__(self, op):
    self._op = op

  def __call__(self, q, k, v, **kwargs):
    plan = getattr(_local, "plan", None)
    if plan is None or "q_sharding" in kwargs or "k_sharding" in kwargs:
      return self._op(q, k, v, **kwargs)
    q_sharding, k_sharding, why = plan
    what = f"GPU flash attention {tuple(q.shape)}"
    if not enabled():
      if q_sharding is not None:
        _note(f"{what}: every device computes every head (MaxText calls "
              "the kernel with no sharding, so XLA gathers q/k/v); "
              "--maxtext_shard_gpu_attention runs it per shard, q "
              f"{q_sharding.spec}")
      return self._op(q, k, v, **kwargs)
    if q_sharding is None:
      _note(f"{what}: MaxText's call kept ({why})")
      return self._op(q, k, v, **kwargs)
    _note(f"{what}: sharded, q {q_sharding.spec}, k/v {k_sharding.spec}")
    return self._op(q, k, v, q_sharding=q_sharding, k_sharding=k_sharding,
                    **kwargs)


class _TokamaxModule:
  """attention_op's `tokamax_pallas_triton` with its flash attention class
  wrapped; every other name is the module's own."""

  def __init__(self, module, op_class: Callable[..., Any]):
    self._module = module
    self._op_class = op_class

  def PallasTritonFlashAttention(self, *args, **kwargs):  # pylint: disable=invalid-name
    return _ShardedOp(self._op_class(*args, **kwargs))

  def __getattr__(self, name):
    return getattr(self._module, name)


def install(op_class: Callable[..., Any] | None = None) -> None:
  """Wraps MaxText's GPU flash attention call; idempotent.

  op_class: the tokamax op to build in place of PallasTritonFlashAttention
    (tests on CPU give tokamax's XLA implementation); None: the Triton one.
  """
  from maxtext.layers import attention_op  # pylint: disable=g-import-not-at-top
  if _originals:
    return
  module = attention_op.tokamax_pallas_triton
  _originals["module"] = module
  _originals["apply_attention"] = attention_op.AttentionOp.apply_attention
  attention_op.tokamax_pallas_triton = _TokamaxModule(
      module, op_class or module.PallasTritonFlashAttention)
  original = _originals["apply_attention"]

  def apply_attention(self, query, key, value, decoder_segment_ids, *args,
                      **kwargs):
    previous = getattr(_local, "plan", None)
    plan = None
    if getattr(self, "attention_kernel", None) in _FLASH and (
        kwargs.get("model_mode") != _AUTOREGRESSIVE):
      try:
        plan = _plan(self, query, key)
      except Exception as e:  # pylint: disable=broad-except
        # Reading MaxText's shardings must never break MaxText's own call.
        plan = (None, None, f"its shardings could not be read: {e!r}")
    if (plan is not None and plan[0] is not None and enabled() and
        decoder_segment_ids is not None):
      # MaxText builds the [batch, seq, seq] segment mask from these ids
      # outside the kernel; whole ids on every device of a batch shard make
      # it there, instead of XLA gathering the mask.
      decoder_segment_ids = jax.lax.with_sharding_constraint(
          decoder_segment_ids, jax.sharding.NamedSharding(
              self.mesh, jax.sharding.PartitionSpec(plan[0].spec[0], None)))
    _local.plan = plan
    try:
      return original(self, query, key, value, decoder_segment_ids, *args,
                      **kwargs)
    finally:
      _local.plan = previous

  apply_attention.__wrapped__ = original
  attention_op.AttentionOp.apply_attention = apply_attention


def patched_names() -> tuple[str, ...]:
  """The MaxText names `install` patched (none when not installed): its
  flash attention call, and the tokamax op class it builds."""
  return (("attention_op.AttentionOp.apply_attention",
           "attention_op.tokamax_pallas_triton.PallasTritonFlashAttention")
          if _originals else ())


def uninstall() -> None:
  """Restores MaxText's own call."""
  if not _originals:
    return
  from maxtext.layers import attention_op  # pylint: disable=g-import-not-at-top
  attention_op.tokamax_pallas_triton = _originals.pop("module")
  attention_op.AttentionOp.apply_attention = _originals.pop("apply_attention")
