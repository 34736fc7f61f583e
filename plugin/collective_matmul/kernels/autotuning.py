"""Optional autotuning of the kernel's tile configuration, cached on disk.

Times every candidate configuration on random inputs of the given local
shape (CUPTI kernel time, minimum over devices per kernel, summed), checks
each result against the `ring` implementation, and stores the fastest in the
cache that `tuning.select_config` reads first (keyed by device kind, dtype,
D and local shape). Needs the GPUs of the ring; run it once per shape.
Tunes the all-gather kernel; the reduce-scatter kernel's cache entries
(`pattern="reduce_scatter"` in `tuning.store_cached_config`) are separate,
so a tuned all-gather config never changes the reduce-scatter kernel.
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

from collective_matmul.kernels import tuning


def candidate_configs():
  """The configurations autotuning tries."""
  for base in tuning._candidates():  # pylint: disable=protected-access
    for gap in (8, 12, 16):
      for width in (4, 8):
        yield dataclasses.replace(base, send_gap=gap, grid_tile_width=width)


def kernel_time_us(f, *args, iterations: int = 10):
  """CUPTI kernel time of `f(*args)` in microseconds, as the seed reports it.

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


def autotune(m: int, k: int, n: int, dtype, mesh, axis_name: str, *,
             configs=None, iterations: int = 5, store: bool = True):
  """Finds the fastest correct config for local shards m x k and k x n.

  Args:
    m, k, n: local (per-device) sizes.
    dtype: bf16 or f16.
    mesh: a mesh whose `axis_name` axis is the ring (its devices NVLink
      peers); other axes must have size 1.
    axis_name: the ring's mesh axis.
    configs: candidates (default `candidate_configs()`).
    iterations: timed runs per candidate.
    store: write the winner to the cache.

  Returns:
    (best config, {config repr: microseconds}).
  """
  from collective_matmul import ops
  d = mesh.shape[axis_name]
  key = jax.random.key(0)
  with jax.set_mesh(mesh):
    a = jax.sharding.reshard(
        jax.random.normal(key, (d * m, k), dtype), P(axis_name, None))
    b = jax.sharding.reshard(
        jax.random.normal(jax.random.fold_in(key, 1), (k, d * n), dtype),
        P(None, axis_name))

    def build(impl, config=None):
      return jax.jit(jax.shard_map(
          functools.partial(ops.all_gather_matmul, axis_name=axis_name,
                            impl=impl, kernel_config=config),
          out_specs=P(None, axis_name), check_vma=False))

    ref = np.asarray(build("ring")(a, b), np.float32)
    results, best = {}, None
    for config in configs or candidate_configs():
      start = time.time()
      try:
        out, us, _ = kernel_time_us(build("pallas", config), a, b,
                                    iterations=iterations)
      except Exception as e:  # A config that does not fit is skipped.
        logging.warning("autotune: %s failed: %s", config, str(e)[:300])
        continue
      err = (np.linalg.norm(np.asarray(out, np.float32) - ref)
             / np.linalg.norm(ref))
      if not err < 1e-2:
        logging.error("autotune: %s gives a wrong result (rel. error %g); "
                      "skipped", config, err)
        continue
      results[repr(config)] = us
      logging.info("autotune %dx%dx%d D=%d: %.1f us %s (%.1f s)", m, k, n, d,
                   us, config, time.time() - start)
      if best is None or us < best[0]:
        best = (us, config)
  if best is None:
    raise RuntimeError(f"autotune: no candidate ran for {m}x{k}x{n}")
  if store:
    path = tuning.store_cached_config(best[1], m, k, n, dtype, d)
    logging.info("autotune: stored %s in %s", best[1], path)
  return best[1], results
