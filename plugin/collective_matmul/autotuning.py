"""Optional autotuning of the kernel's tile configuration, cached on disk.

Times every candidate configuration on random inputs of the given local
shape (CUPTI kernel time, minimum over devices per kernel, summed), checks
each result against the `ring` implementation, and stores the fastest in the
cache that `selection.config_for` reads first (keyed by device kind, dtype,
D and local shape). Needs the GPUs of the ring; run it once per shape.
Tunes either kernel (`collective`); the two kernels' cache entries are keyed
apart, so a tuned all-gather config never changes the reduce-scatter
kernel and vice versa.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from collective_matmul import ops
from collective_matmul import selection
from collective_matmul.enums import Collective
from collective_matmul.enums import Impl


COLLECTIVES = selection.CACHE_COLLECTIVES

# What a candidate that does not fit in shared memory raises (all
# ValueError): Mosaic GPU's launch check (jax/experimental/mosaic/gpu/
# core.py), its allocator (dialect_lowering.py), and the kernels' own check
# before tracing (kernels/ring_skeleton.py: check_shared_memory). JAX's own
# sweep (pallas/ops/gpu/hopper_matmul_mgpu.py) skips the first the same way.
SHARED_MEMORY_ERRORS = ("exceeds available shared memory",
                        "Ran out of shared memory",
                        "bytes of shared memory, more than the")


def _normal(key, shape, dtype):
  """N(0, 1) values of `dtype` (fp8: drawn in f32, then rounded)."""
  if selection.is_fp8(dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)
  return jax.random.normal(key, shape, dtype)


def _sweep_operands(collective, problem, d, axis_name):
  """(((shape, dtype) of x and of the weight), (their specs, the
  result's), the op, `product(op, x, w, **kw)`) a sweep times at D = d.
  An fp8 problem's weight is held K-major (`[n, k]`, as its quantization
  writes it) and handed to the op transposed, which the dispatch's
  transpose folds away; its product takes a per-tensor scale (1) into its
  epilogue and gives the problem's result dtype."""
  lhs, rhs = problem.operand_dtypes
  m, k, n = problem.rows, problem.k, problem.n
  all_gather = collective == Collective.ALL_GATHER
  x_shape = (d * m, k) if all_gather else (d * m, d * k)
  out = P(None, axis_name) if all_gather else P(axis_name, None)
  op = ops.all_gather_matmul if all_gather else ops.matmul_reduce_scatter
  if not problem.is_fp8:
    w_shape = (k, d * n) if all_gather else (d * k, n)
    w_spec = P(None, axis_name) if all_gather else P(axis_name, None)
    x_spec = P(axis_name, None) if all_gather else P(None, axis_name)
    return (((x_shape, lhs), (w_shape, rhs)), (x_spec, w_spec, out), op,
            lambda op, x, w, **kw: op(x, w, **kw))
  w_shape = (d * n, k) if all_gather else (n, d * k)
  x_spec, w_spec = ((P(axis_name, None), P(axis_name, None)) if all_gather
                    else (P(None, axis_name), P(None, axis_name)))

  def product(op, x, w_nk, **kw):
    return op(x, w_nk.T, scale=jnp.float32(1),
              preferred_element_type=problem.result_dtype, **kw)
  return (((x_shape, lhs), (w_shape, rhs)), (x_spec, w_spec, out), op,
          product)


def does_not_fit(error: BaseException) -> bool:
  """Whether `error` says a candidate config needs more shared memory than
  a block has (a candidate to skip, not a bug)."""
  return isinstance(error, ValueError) and any(
      needle in str(error) for needle in SHARED_MEMORY_ERRORS)


def candidate_configs(collective: Collective | str = Collective.ALL_GATHER,
                      problem: selection.Problem | None = None, device=None):
  """The configurations autotuning tries for `collective` (for `problem`'s
  dtypes; without a problem, for bf16).

  All-gather: with the problem given, the heuristic's own choice
  (`selection.heuristic_config`) first; then every tile candidate x send gap
  x grid width, and every tile candidate x grid width with
  `selection.SENDER_SMS` dedicated sender blocks, by rows and k-major (send
  gaps do not apply to those), k-major also with the wide k step
  (`selection.SENDER_WIDE_TILE_K`) where enough pipeline stages fit;
  chained tiles (`chain_tiles`) with the senders by rows and, released
  eagerly, with each send gap, as `selection` takes them where measured.
  Reduce-scatter (needs the problem): the chosen config of the problem
  first, then the heuristic's split-tile config (before ping-pong) with
  the send pacing around it (row pieces x send gap; the pacing that wins
  depends on how many waves a ring step takes), and unpaced; where that
  config has one-slot 64 x 256 warpgroup tiles, the same for the two-slot
  128 x 128 ones they replace (the heuristic takes them from core timings,
  autotuning times both in the ring). Both:
  ping-pong warpgroups on 128 x 128 and 128 x 192 tiles and with a
  one-slot epilogue (`_pingpong_candidates`; the all-gather's released
  eagerly and with the senders by rows): the heuristic takes the 128 x 192
  ones only where they won at D = 1, autotuning wherever they win. Every
  candidate is one the problem can run (`selection.config_reason`),
  duplicates dropped. `device`: the
  `selection.DeviceFacts` the choices read (None: this machine's; a plan
  on CPU passes those of the GPU it stands for).
  """
  collective = Collective.parse(collective, "collective")
  if collective == Collective.ALL_GATHER:
    seen = set()
    for config in _all_gather_candidates(problem, device):
      # A grid config the problem's dtypes cannot run (fp8 without its k
      # step; over shared memory at its element sizes) is not a candidate.
      if config not in seen and (problem is None or selection.config_reason(
          config, problem) is None):
        seen.add(config)
        yield config
    return
  if problem is None:
    raise ValueError("reduce-scatter candidates need the problem")
  device = device or selection.device_facts()
  chosen = selection.config_for(Collective.REDUCE_SCATTER, problem,
                                device)[0]
  # The split-tile configs (the heuristic's before ping-pong, with and
  # without one-slot wide tiles): their pacing.
  bases = [selection.heuristic_config(Collective.REDUCE_SCATTER, problem,
                                      device, pingpong=False,
                                      wide_tiles=wide)
           for wide in (True, False)]
  seen = set()
  for config in _reduce_scatter_candidates(chosen, bases):
    if config not in seen and selection.config_reason(config,
                                                      problem) is None:
      seen.add(config)
      yield config


def _reduce_scatter_candidates(chosen, bases):
  """`candidate_configs`' reduce-scatter list, in order, duplicates
  included: `chosen` first, then each of `bases` paced every way, then
  ping-pong from the first."""
  yield chosen
  for base in bases:
    # Pieces per slot of a two-slot epilogue: a one-slot epilogue holds
    # both slots' rows, so it takes twice the pieces for stores of the same
    # size.
    per_slot = 2 if base.epi_slots == 1 else 1
    yield base
    for pieces, gaps in ((1, (12, 24)), (2, (6, 12, 16)), (4, (4, 6))):
      for gap in gaps:
        try:
          yield dataclasses.replace(base, send_pieces=per_slot * pieces,
                                    send_gap=gap)
        except ValueError:  # Pieces that do not split this epilogue tile.
          continue
    yield dataclasses.replace(base, spread_sends=False, send_pieces=1)
  yield from _pingpong_candidates(bases[0])


def _all_gather_candidates(problem, device):
  """`candidate_configs`' all-gather list, in order, duplicates included:
  the heuristic's own choice first where the problem is given (so the sweep
  always times the default, e.g. its sender count on idle SMs, which the
  grid lacks), then the grid."""
  itemsizes = (2, 2)  # bf16
  if problem is not None:
    itemsizes = problem.itemsizes
    yield selection.heuristic_config(Collective.ALL_GATHER, problem,
                                     device or selection.device_facts())
  for base in selection.tile_candidates(problem):
    for gap in (8, 12, 16):
      for width in (4, 8):
        yield dataclasses.replace(base, send_gap=gap, grid_tile_width=width)
      yield dataclasses.replace(base, send_gap=gap, eager_release=True,
                                chain_tiles=True)
    for width in (4, 8):
      for k_major, chain in ((False, False), (False, True), (True, False)):
        yield dataclasses.replace(base, sender_sms=selection.SENDER_SMS,
                                  k_major_sends=k_major, chain_tiles=chain,
                                  grid_tile_width=width)
      wide = selection.wide_sender_tiles(dataclasses.replace(
          base, sender_sms=selection.SENDER_SMS, k_major_sends=True,
          grid_tile_width=width), *itemsizes)
      if wide is not None:
        yield wide
    # The whole block forwarded by n-tile 0 (no spread sends).
    yield dataclasses.replace(base, spread_sends=False)
  first = next(iter(selection.tile_candidates(problem)))
  yield from _pingpong_candidates(first, eager_release=True)
  yield from _pingpong_candidates(first, sender_sms=selection.SENDER_SMS)


def _pingpong_candidates(base, **fields):
  """Ping-pong warpgroups (`TileConfig.pingpong`) from `base`: 128 x 128 and
  128 x 192 tiles, and a one-slot epilogue of the whole 128 x 128 tile,
  chained as ping-pong needs; `fields` as the kernel's ring needs them (the
  all-gather's tiles free their slots at once)."""
  common = dict(tile_m=128, wg_dimension="n", chain_tiles=True,
                pingpong=True, **fields)
  for shape in (dict(tile_n=128, epi_tile_m=64, epi_tile_n=64, epi_slots=2),
                dict(tile_n=192, epi_tile_m=64, epi_tile_n=64, epi_slots=2),
                dict(tile_n=128, epi_tile_m=128, epi_tile_n=128, epi_slots=1,
                     max_concurrent_steps=5)):
    try:
      yield dataclasses.replace(base, **shape, **common)
    except ValueError:  # Send pieces that do not split this epilogue.
      continue


def kernel_time_us(f, *args, iterations: int = 10):
  """CUPTI kernel time of `f(*args)` in microseconds, as JAX's
  `pallas/ops/gpu/collective_matmul_mgpu.py` reports it.

  For each kernel name the minimum over devices (a device that waited for
  its peer does not count its wait), summed over names; the median over
  `iterations` runs. Returns (the first run's output, time, {kernel name:
  median time}).
  """
  from jax.experimental.mosaic.gpu import profiler
  out, timings = profiler.measure(f, aggregate=False,
                                  iterations=iterations)(*args)
  if timings and isinstance(timings[0], tuple):
    timings = [timings]
  per_iter, per_name = [], {}
  for kernels in timings:
    best: dict[str, float] = {}
    for name, ms in kernels:
      best[name] = min(ms, best.get(name, float("inf")))
      per_name.setdefault(name, []).append(ms * 1e3)
    per_iter.append(sum(best.values()) * 1e3)
  breakdown = {name: round(statistics.median(v), 2)
               for name, v in per_name.items()}
  return out, statistics.median(per_iter), breakdown


def _final_rounds(finalists, operands, rounds, iterations, results):
  """Times each finalist `(us, config, f)` `rounds - 1` more times,
  round-robin; records each one's median over all its rounds in `results`
  and returns (median, config) of the best."""
  times = {repr(config): [us] for us, config, _ in finalists}
  for _ in range(rounds - 1):
    for _, config, f in finalists:
      _, us, _ = kernel_time_us(f, *operands, iterations=iterations)
      times[repr(config)].append(us)
  best = None
  for _, config, _ in finalists:
    median = statistics.median(times[repr(config)])
    results[repr(config)] = median
    logging.info("autotune final rounds: %s: median %.1f us of %s", config,
                 median, [round(t, 1) for t in times[repr(config)]])
    if best is None or median < best[0]:
      best = (median, config)
  return best


def autotune(problem: selection.Problem, mesh, axis_name: str, *,
             configs=None, iterations: int = 5, store: bool = True,
             collective: Collective | str = Collective.ALL_GATHER,
             rounds: int = 1, finalists: int = 3):
  """Finds the fastest correct config for one kernel and local shape.

  Args:
    problem: the per-device problem: all-gather, shards rows x k and
      k x n; reduce-scatter, rows after the scatter, k local contraction,
      n output columns (the kernel's x is D*rows x k); bf16 or f16, or an
      fp8 pair with its result dtype (`_sweep_operands`); its axis size
      that of `axis_name`.
    mesh: a mesh whose `axis_name` axis is the ring (its devices NVLink
      peers); other axes must have size 1.
    axis_name: the ring's mesh axis.
    configs: candidates (default `candidate_configs()`).
    iterations: timed runs per candidate.
    store: write the winner to the cache.
    collective: "all_gather" or "reduce_scatter": which kernel.
    rounds, finalists: with rounds > 1, the `finalists` fastest candidates
      of the sweep are timed `rounds - 1` more times, round-robin, and the
      winner is the best median over all its rounds. One reading each
      cannot rank configs a few percent apart: a kernel's time drifts
      between readings by more than that (docs/TUNING.md, "Autotuning").

  Returns:
    (best config, {config repr: microseconds}); a finalist's time is its
    median over the rounds.
  """
  if rounds < 1 or finalists < 1:
    raise ValueError(f"rounds={rounds} and finalists={finalists} must be "
                     ">= 1")
  collective = Collective.parse(collective, "collective")
  d = mesh.shape[axis_name]
  if problem.axis_size != d:
    raise ValueError(f"the problem's axis size {problem.axis_size} is not "
                     f"that of mesh axis {axis_name!r} ({d})")
  m, k, n = problem.rows, problem.k, problem.n
  key = jax.random.key(0)
  operands, specs, op, product = _sweep_operands(collective, problem, d,
                                                 axis_name)
  with jax.set_mesh(mesh):
    a, b = (jax.sharding.reshard(_normal(k_, shape, dtype), spec)
            for k_, (shape, dtype), spec in zip(
                (key, jax.random.fold_in(key, 1)), operands, specs))

    def build(impl, config=None):
      return jax.jit(jax.shard_map(
          lambda x, w: product(op, x, w, axis_name=axis_name, impl=impl,
                               kernel_config=config),
          out_specs=specs[2], check_vma=False))

    ref = np.asarray(build(Impl.RING)(a, b), np.float32)
    results, best, timed = {}, None, []
    if configs is None:
      configs = list(candidate_configs(collective, problem))
    for config in configs:
      start = time.time()
      f = build(Impl.PALLAS, config)
      try:
        out, us, _ = kernel_time_us(f, a, b, iterations=iterations)
      except ValueError as e:
        if not does_not_fit(e):
          raise
        logging.warning("autotune: %s does not fit in shared memory: %s",
                        config, str(e)[:300])
        continue
      err = (np.linalg.norm(np.asarray(out, np.float32) - ref)
             / np.linalg.norm(ref))
      if not err < 1e-2:
        logging.error("autotune: %s gives a wrong result (rel. error %g); "
                      "skipped", config, err)
        continue
      results[repr(config)] = us
      timed.append((us, config, f))
      logging.info("autotune %s %dx%dx%d D=%d: %.1f us %s (%.1f s)",
                   collective, m, k, n, d, us, config, time.time() - start)
      if best is None or us < best[0]:
        best = (us, config)
    if best is not None and rounds > 1:
      best = _final_rounds(sorted(timed, key=lambda t: t[0])[:finalists],
                           (a, b), rounds, iterations, results)
  if best is None:
    raise RuntimeError(f"autotune: no candidate ran for {m}x{k}x{n}")
  if store:
    path = selection.store_cached_config(
        best[1], problem, selection.device_facts().device_kind,
        collective=collective)
    logging.info("autotune: stored %s in %s", best[1], path)
  return best[1], results
