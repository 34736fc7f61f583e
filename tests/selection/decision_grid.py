"""The grid of problems whose decisions and configs are pinned across the
selection redesign (`test_decisions_unchanged.py`).

`new_rows()` gives {key: value} strings: for every case, what the implementation
decision gives (forward impl, backward impl, reason, fallback) and which
config with which source each kernel would run. The stored table
(`data/decisions_before.json.gz`) was made on the code before the redesign
(d8888bb's `selection.choose_impl`, `select_config`,
`select_reduce_scatter_config`, `config_source`) by this file as it stood at
commit 0ea5d74 (`git show 0ea5d74:tests/selection/decision_grid.py`, its
`main`); the test computes the same rows with today's `selection.choose`
and compares.
"""
from __future__ import annotations

import gzip
import itertools
import json
import os

import numpy as np

DEVICES = (("gpu", "NVIDIA H200", 132), ("gpu", "NVIDIA H100 PCIe", 114),
           ("gpu", "NVIDIA A100-SXM4-80GB", 108), ("cpu", "cpu", 132))
ROWS = (64, 128, 256, 512, 1024, 4096, 8192)
KS = (1024, 2048, 4096, 5504, 7168, 14336)
NS = (1024, 2048, 4096, 5504, 6144, 11008)
AXES = (1, 2, 4, 8)
DTYPES = (("bfloat16", None), ("bfloat16", "float32"), ("float16", None),
          ("float32", None))
REQUESTED = ("auto", "pallas")
COLLECTIVES = ("all_gather", "reduce_scatter")
# (fallback_impl, reduce_scatter_kernel) pairs; the second and third only on
# the H200 (the rules do not depend on the device there).
OPTIONS = (("ring", True), ("baseline", True), ("ring", False))


def cases():
  for (platform, kind, cores), rows, k, n, axis, (dtype, out), req, coll in (
      itertools.product(DEVICES, ROWS, KS, NS, AXES, DTYPES, REQUESTED,
                        COLLECTIVES)):
    for fallback, rs_kernel in OPTIONS:
      if (fallback, rs_kernel) != OPTIONS[0] and (
          kind != "NVIDIA H200" or dtype != "bfloat16" or out):
        continue
      yield dict(platform=platform, kind=kind, cores=cores, rows=rows, k=k,
                 n=n, axis=axis, dtype=dtype, out=out, requested=req,
                 collective=coll, fallback=fallback, rs_kernel=rs_kernel)


def key(case) -> str:
  return ("{kind}|{rows}x{k}x{n}|D={axis}|{dtype}->{out}|{requested}|"
          "{collective}|{fallback}|{rs_kernel}").format(**case)


def config_text(config) -> str:
  return json.dumps(config.to_json(), sort_keys=True)


PATH = os.path.join(os.path.dirname(__file__), "data",
                    "decisions_before.json.gz")


def new_rows(selected_cases=None):
  """The rows as `selection.choose` computes them today."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from collective_matmul import selection  # pylint: disable=g-import-not-at-top
  out = {}
  for case in selected_cases or cases():
    device = selection.DeviceFacts(case["platform"], case["kind"],
                                   case["cores"])
    dtype = np.dtype(jnp.bfloat16 if case["dtype"] == "bfloat16"
                     else case["dtype"])
    out_dtype = None if case["out"] is None else np.dtype(case["out"])
    plan = selection.choose(
        case["requested"], case["collective"],
        selection.Problem(case["rows"], case["k"], case["n"], dtype,
                          case["axis"], out_dtype),
        device, selection.Options(case["fallback"], case["rs_kernel"]))
    row = [str(plan.impl), str(plan.backward_impl), plan.reason,
           str(plan.is_fallback)]
    # The kernels' configs (a ring's own config is not in the table).
    if plan.impl == "pallas":
      row += [config_text(plan.config), plan.source]
    if plan.backward_impl == "pallas":
      row += [config_text(plan.backward_config), plan.backward_source]
    out[key(case)] = "|".join(row)
  return out


def stored_rows():
  """The stored rows, their configs without the fields removed since
  (`configs.REMOVED_FIELDS`) where they hold the value the kernels now
  always take (one at another value is kept, and differs), and with the
  heuristic rules added since applied (`with_later_rules`)."""
  cases_by_key = {key(c): c for c in cases()}
  with gzip.open(PATH, "rt") as f:
    return {k: with_later_rules(cases_by_key.get(k), _without_removed_fields(v))
            for k, v in json.load(f).items()}


def with_later_rules(case, row: str) -> str:
  """`row` with the heuristic rules added after the redesign applied to its
  heuristic configs, as the heuristics apply them last: one-slot 64 x 256
  warpgroup tiles in bf16 too (`heuristics._wide_tiles`, once fp8 only;
  a config it already gave is left as it is), then ping-pong tiles
  (`heuristics._pingpong_tiles`), to each kernel's config for its own
  problem (the backward's: the transposed collective's, on the backward
  problem). Packaged-table configs are left as they are."""
  if case is None:
    return row
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from collective_matmul import selection  # pylint: disable=g-import-not-at-top
  from collective_matmul.enums import Collective  # pylint: disable=g-import-not-at-top
  from collective_matmul.selection import heuristics  # pylint: disable=g-import-not-at-top
  from collective_matmul.selection import tuned  # pylint: disable=g-import-not-at-top
  parts = row.split("|")
  dtype = np.dtype(jnp.bfloat16 if case["dtype"] == "bfloat16"
                   else case["dtype"])
  out_dtype = None if case["out"] is None else np.dtype(case["out"])
  forward = selection.Problem(case["rows"], case["k"], case["n"], dtype,
                              case["axis"], out_dtype)
  collective = Collective(case["collective"])
  kernels = []  # (index of the config in `parts`, collective, problem)
  if parts[0] == "pallas":
    kernels.append((4, collective, forward))
  if parts[1] == "pallas":
    kernels.append((6 if parts[0] == "pallas" else 4, collective.transpose,
                    forward.backward()))
  for i, kernel, problem in kernels:
    if parts[i + 1] != "heuristic":
      continue
    config = tuned.config_from_fields(kernel, json.loads(parts[i]))
    config = heuristics._wide_tiles(config, problem)  # pylint: disable=protected-access
    config = heuristics._pingpong_tiles(config, problem, case["cores"])  # pylint: disable=protected-access
    parts[i] = config_text(config)
  return "|".join(parts)


def _without_removed_fields(row: str) -> str:
  from collective_matmul.kernels.configs import REMOVED_FIELDS  # pylint: disable=g-import-not-at-top
  parts = row.split("|")
  for i, part in enumerate(parts):
    if part.startswith("{"):
      config = json.loads(part)
      for name, value in REMOVED_FIELDS.items():
        if name in config and config[name] == value:
          del config[name]
      parts[i] = json.dumps(config, sort_keys=True)
  return "|".join(parts)
