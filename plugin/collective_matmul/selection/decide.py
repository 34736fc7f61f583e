"""The one decision: which implementation and config serve a collective
matmul, forward and backward (`choose` -> `plan.KernelPlan`).

`choose` is called once per matmul, by the drop-in `dot_general` (or by a
public op called without a plan); the plan then travels down to the ops and
the kernels, which never decide again.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from collective_matmul.enums import Collective
from collective_matmul.enums import Impl
from collective_matmul.enums import WeightLayout
from collective_matmul.kernels.configs import TileConfig
from collective_matmul.plan import KernelPlan
from collective_matmul.ring import RingConfig
from collective_matmul.selection import applicability
from collective_matmul.selection import heuristics
from collective_matmul.selection import tuned
from collective_matmul.selection.device import DeviceFacts
from collective_matmul.selection.problem import Problem

HEURISTIC = "heuristic"
CALLER = "caller"  # A config given explicitly to the op.


@dataclasses.dataclass(frozen=True)
class Options:
  """The configuration's say in the decision.

  fallback_impl: where the kernel is unavailable off Hopper.
  reduce_scatter_kernel: whether the matmul-reduce-scatter kernel may run.
  bidirectional: the ring's direction (`RingConfig`), wherever it runs.
  """

  fallback_impl: Impl = Impl.RING
  reduce_scatter_kernel: bool = True
  bidirectional: bool = True

  def config(self, impl: Impl) -> RingConfig | None:
    """The config of a portable `impl` (ring or baseline) under these
    options."""
    return RingConfig(self.bidirectional) if impl == Impl.RING else None


def config_for(collective: Collective, problem: Problem, device: DeviceFacts
               ) -> tuple[TileConfig, str]:
  """`collective`'s kernel config for `problem` on `device`, with its
  source: the autotune cache (single-process programs), the packaged table,
  else the heuristics."""
  found = tuned.measured_config(collective, problem, device.device_kind)
  if found is not None:
    return found
  return heuristic_config(collective, problem, device), HEURISTIC


def heuristic_config(collective: Collective, problem: Problem,
                     device: DeviceFacts, pingpong: bool = True,
                     wide_tiles: bool = True) -> TileConfig:
  """`collective`'s kernel config for `problem` by the heuristics alone,
  whatever is measured; without ping-pong warpgroups unless `pingpong`,
  without one-slot 64 x 256 warpgroup tiles unless `wide_tiles` (the
  configs they replace, which autotuning also times)."""
  pick = (heuristics.all_gather_config if collective == Collective.ALL_GATHER
          else heuristics.reduce_scatter_config)
  return pick(problem, device.num_cores, pingpong, wide_tiles)


class _Verdict(NamedTuple):
  """Why the Hopper kernel is not used: `impl` instead; `hard`: it cannot
  or may not run (an explicit `pallas` falls back), else it would only be
  slower (`auto` avoids it, an explicit `pallas` still runs it)."""

  reason: str
  impl: Impl
  hard: bool


def _kernel(collective: Collective, problem: Problem, device: DeviceFacts,
            options: Options, config: TileConfig | None
            ) -> tuple[_Verdict | None, TileConfig | None, str]:
  """(why not the kernel or None, its config, the config's source) for
  `collective` on `problem`; `config`: the caller's, else chosen here."""
  reason = applicability.unsupported_reason(problem, device)
  if reason is not None:
    # fp8 (or rowwise scales) the kernels do not take runs XLA's GEMM on a
    # Hopper GPU (what the program runs without the plugin), not the
    # portable ring.
    instead = (Impl.BASELINE if (problem.is_fp8 or problem.rowwise)
               and device.is_hopper
               and device.platform in ("gpu", "cuda")
               else options.fallback_impl)
    return (_Verdict(f"pallas unavailable: {reason}", instead, True), None,
            "")
  reason = (applicability.command_buffer_reason(device.platform) or
            applicability.process_layout_reason(problem, device))
  if reason is not None:
    return (_Verdict(f"pallas unavailable: {reason}", Impl.BASELINE, True),
            None, "")
  if collective == Collective.REDUCE_SCATTER and not (
      options.reduce_scatter_kernel):
    return (_Verdict("the reduce-scatter kernel is switched off",
                     Impl.BASELINE, True), None, "")
  if config is None:
    config, source = config_for(collective, problem, device)
  else:
    source = CALLER
  reason = applicability.config_reason(config, problem)
  if reason is not None:
    return (_Verdict(f"pallas unavailable: {reason}", Impl.BASELINE, True),
            None, "")
  slower = applicability.too_small_reason(config, problem, device.num_cores)
  if slower is not None:
    return _Verdict(slower, Impl.BASELINE, False), config, source
  return None, config, source


def choose(requested: Impl | str, collective: Collective | str,
           problem: Problem, device: DeviceFacts,
           options: Options = Options(), *,
           config: TileConfig | None = None) -> KernelPlan:
  """The one implementation decision, forward and backward, with configs.

  `auto` takes the Hopper kernel where it applies and pays off, else XLA's
  collective + GEMM (NCCL + cuBLAS) where the kernel may not run on this
  Hopper GPU or a problem is too small to overlap, else (off Hopper)
  `options.fallback_impl`. An explicit `pallas` runs the kernel wherever it
  can, small problems included; where it cannot, that is a fallback
  (`is_fallback`). The backward's collective matmul (the other collective,
  `problem.backward()`) is chosen by the same rules once the forward runs
  the kernel. Where a kernel runs, the plan also says how it takes its
  operands: the weight K-major for fp8, the rows in their runs where the
  config's tiles fit them (`plan.KernelPlan.for_rows`).

  Args:
    requested: the configured implementation (auto, pallas, ring, baseline).
    collective: the forward's (all_gather or reduce_scatter).
    problem: the forward's per-shard problem.
    device: the mesh's device facts (`device_facts`).
    options: the configuration's fallback and kernel switches.
    config: the forward's kernel config, if the caller fixed one.
  """
  requested = Impl.parse(requested, "impl")
  collective = Collective.parse(collective, "collective")
  plan = _choose(requested, collective, problem, device, options, config)
  backward = problem.backward()
  plan = dataclasses.replace(
      plan, weight_layout=_weight_layout(problem),
      backward_weight_layout=_weight_layout(backward)).for_rows(
          problem.rows, problem.rows_per_batch)
  if not (problem.is_fp8 or problem.rowwise):
    return plan
  return dataclasses.replace(plan, dtypes=problem.dtype_label(),
                             backward_dtypes=backward.dtype_label())


def _weight_layout(problem: Problem) -> WeightLayout:
  """How the kernel takes `problem`'s weight: K-major (`[n, k]`) for fp8
  operands, which 8-bit wgmma reads so, else as the matmul names it (a
  portable plan drops it)."""
  return WeightLayout.NK if problem.is_fp8 else WeightLayout.KN


def _choose(requested: Impl, collective: Collective, problem: Problem,
            device: DeviceFacts, options: Options,
            config: TileConfig | None) -> KernelPlan:
  """`choose` without the dtype labels and the operands' layouts."""
  if requested in (Impl.RING, Impl.BASELINE):
    return KernelPlan(requested, requested, options.config(requested),
                      backward_config=options.config(requested))
  verdict, config, source = _kernel(collective, problem, device, options,
                                    config)
  if verdict is not None and (requested == Impl.AUTO or verdict.hard):
    return KernelPlan(verdict.impl, verdict.impl, options.config(verdict.impl),
                      backward_config=options.config(verdict.impl),
                      reason=verdict.reason,
                      is_fallback=requested == Impl.PALLAS and verdict.hard)
  back, back_config, back_source = _kernel(
      collective.transpose, problem.backward(), device, options, None)
  if back is not None and (requested == Impl.AUTO or back.hard):
    return KernelPlan(Impl.PALLAS, back.impl, config, source,
                      options.config(back.impl))
  return KernelPlan(Impl.PALLAS, Impl.PALLAS, config, source, back_config,
                    back_source)
