"""The record of what the drop-in `dot_general` decided at trace time.

Every matmul that reaches the plugin with it enabled leaves one `Decision`:
rewritten (with the plan that runs, forward and backward), or left to XLA
(or to the framework's own path) with the reason. `decisions()` returns them
in trace order, `format_decisions()` sums them up; strict mode raises
`StrictFallbackError` where a fallback would be recorded.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

from absl import logging

from collective_matmul.plan import KernelPlan
from collective_matmul.enums import Collective
from collective_matmul.enums import Impl


# A gradient's own matmul is recorded under its forward's name with this
# suffix (fp8's dgrad: `fp8.Fp8Dots.dgrad`), so summaries count it apart
# from the projections.
GRADIENT_SUFFIX = "/dgrad"
# What `format_decisions`' "[xN]" means, printed under it.
REPEAT_NOTE = (
    "[xN]: the same decision made N times, once per trace of that matmul: "
    "in a scanned or rematerialized layer JAX traces a custom-gradient op "
    "twice (its function, then its forward rule), and each unscanned layer "
    "traces its own; one projection, not N")


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the override did with one `dot_general` at trace time.

  `rewritten` with `impl`, or not, with `reason` (also set when rewritten
  with a fallback implementation, saying why). `plan`: what runs, forward
  and backward, with each implementation's config (the kernels' with their
  sources).
  """

  name: str | None
  rewritten: bool
  impl: Impl | None
  reason: str
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  dtype: str
  axis: str | None = None
  mode: str | None = None  # "explicit" or "logical" sharding information.
  collective: Collective | None = None  # The pattern matched, if any.
  backward_impl: Impl | None = None  # The backward's collective matmul.
  # Mesh axes the weight was all-gathered over before the ring (FSDP).
  weight_gathered: tuple[str, ...] = ()
  # Every member's name when this projection ran in one collective matmul
  # with siblings of the same activation (`grouping`), else ().
  group: tuple[str | None, ...] = ()
  # Why a projection given with siblings was not grouped with them.
  group_reason: str = ""
  plan: KernelPlan | None = None

  def __post_init__(self):
    for name, vocabulary in (("impl", Impl), ("backward_impl", Impl),
                             ("collective", Collective)):
      value = getattr(self, name)
      if value is not None:
        object.__setattr__(self, name, vocabulary.parse(value, name))

  def __str__(self):
    return self.describe()

  def what_runs(self, dtypes: bool = True) -> str:
    """What serves a rewritten call: "ring over 'x'", "pallas 128x256x64
    s4 (packaged table) over 'x' (matmul + reduce-scatter)", "pallas e4m3 x
    e4m3 -> bf16 128x256x128 s4 (heuristic) over 'x'": the forward's
    implementation with its config (and, with `dtypes`, fp8's dtypes), the
    mesh axis and, for the reduce-scatter, the collective."""
    forward = (self.plan.describe(dtypes=dtypes) if self.plan
               else str(self.impl))
    how = f"{forward} over {self.axis!r}"
    if self.collective == Collective.REDUCE_SCATTER:
      how += " (matmul + reduce-scatter)"
    return how

  def describe(self, shared_reason: str = "") -> str:
    """One line; `shared_reason` (said once elsewhere, e.g. in a summary's
    header) is left out. The line names the call's dtypes once, before what
    runs; a backward of other dtypes (fp8's) names its own."""
    what = (f"rewritten -> {self.what_runs(dtypes=False)}" if self.rewritten
            else "left to XLA")
    plan = self.plan
    if self.rewritten and plan is not None and (
        plan.backward_impl == Impl.PALLAS
        or plan.describe(backward=True, dtypes=False)
        != plan.describe(dtypes=False)):
      what += f", backward {plan.describe(backward=True)}"
    if self.weight_gathered:
      what += f", weight gathered over {self.weight_gathered}"
    if self.group:
      others = [str(n).rsplit("/", 1)[-1] for n in self.group
                if n != self.name]
      what += f", grouped with {', '.join(others)}"
    # A member left alone because it is not rewritten has its reason in
    # the group's already.
    own = self.reason not in ("", shared_reason) and not (
        self.group_reason and self.reason in self.group_reason)
    why = f" ({self.reason})" if own else ""
    if self.group_reason:
      why += f" (not grouped: {self.group_reason})"
    return (f"{self.name or 'dot_general'} {self.lhs_shape}x{self.rhs_shape} "
            f"{self.dtype}: {what}{why}")

  def refusal(self) -> str:
    """What strict mode says of this decision when it is a fallback."""
    instead = (f"it would run {self.what_runs()}" if self.rewritten
               else "it would be left to XLA")
    return (f"{self.name or 'dot_general'} {self.lhs_shape}x{self.rhs_shape} "
            f"{self.dtype} cannot be served as configured ({self.reason}); "
            f"{instead}")


class StrictFallbackError(ValueError):
  """Strict mode (`CollectiveMatmulConfig.strict`) refusing a fallback: a
  pattern was found but could not be served as configured."""


_record_lock = threading.Lock()
_decisions: list[Decision] = []
_logged_fallbacks: set[str] = set()


def decisions() -> list[Decision]:
  """Every decision since the last `clear_decisions()`, in trace order."""
  with _record_lock:
    return list(_decisions)


def clear_decisions() -> None:
  with _record_lock:
    _decisions.clear()


def format_decisions(records: Sequence[Decision] | None = None) -> str:
  """A short human summary: one line per distinct decision, with counts."""
  records = decisions() if records is None else records
  # A reason every rewritten decision gives (e.g. why not the Hopper kernel,
  # on CPU) is said once, in the header.
  reasons = {r.reason for r in records if r.rewritten}
  shared = reasons.pop() if len(reasons) == 1 else ""
  counts: dict[str, int] = {}
  for decision in records:
    line = decision.describe(shared)
    counts[line] = counts.get(line, 0) + 1
  rewritten = sum(r.rewritten for r in records)
  lines = [f"collective matmul: {rewritten} of {len(records)} dot_generals "
           "rewritten" + (f" (each: {shared})" if shared else "")]
  lines += [f"  {line}" + (f"  [x{n}]" if n > 1 else "")
            for line, n in counts.items()]
  if any(n > 1 for n in counts.values()):
    lines.append(f"  {REPEAT_NOTE}")
  return "\n".join(lines)


def record(decision: Decision, strict: bool, fallback: bool) -> None:
  """Records a decision. A fallback (the pattern is there but not served as
  asked) is logged as a warning once per distinct decision; everything else
  only at verbosity 1 (`--v=1`): `format_decisions()` is the summary."""
  with _record_lock:
    _decisions.append(decision)
    first = fallback and str(decision) not in _logged_fallbacks
    if first:
      _logged_fallbacks.add(str(decision))
  if strict and fallback:
    raise StrictFallbackError(
        f"collective matmul (strict): {decision.refusal()}")
  if first:
    logging.warning("collective matmul fallback: %s", decision)
  else:
    logging.vlog(1, "collective matmul: %s", decision)


def record_not_served(name: str | None, reason: str, *, lhs_shape=(),
                      rhs_shape=(), dtype, mode: str | None = None) -> None:
  """Records a matmul an entry point above `dot_general` left on its own
  path (an einsum that is not one contraction; a framework projection that
  is quantized, fp8, unknown, ...), so the decision record accounts for
  every matmul, not only those that reached the matcher."""
  record(Decision(name=name, rewritten=False, impl=None, reason=reason,
                  lhs_shape=tuple(lhs_shape), rhs_shape=tuple(rhs_shape),
                  dtype=str(dtype), mode=mode), strict=False,
         fallback=False)
