"""The grid of problems whose decisions and configs are pinned across the
selection redesign (`test_decisions_unchanged.py`).

`rows()` yields (key, value) strings: for every case, what the implementation
decision gives (forward impl, backward impl, reason, fallback) and which
config with which source each kernel would run. The stored table
(`data/decisions_before.json.gz`) was made by this file's `main` on the code
before the redesign (commit d8888bb's `selection.choose_impl`,
`select_config`, `select_reduce_scatter_config`, `config_source`); the test
computes the same rows with today's `selection.choose` and compares.
"""
from __future__ import annotations

import gzip
import itertools
import json
import os
import sys

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


def old_rows():
  """The rows as the code before the redesign computes them."""
  from collective_matmul import selection  # pylint: disable=g-import-not-at-top
  from collective_matmul.enums import Collective  # pylint: disable=g-import-not-at-top
  out = {}
  for case in cases():
    device = selection.DeviceFacts(case["platform"], case["kind"],
                                   case["cores"])
    # The old code keyed its table lookups by the local device's kind; on
    # a machine of the case's kind that is the case's kind.
    selection._local_device_kind = lambda kind=case["kind"]: kind  # pylint: disable=protected-access
    dtype = np.dtype(case["dtype"]) if case["dtype"] != "bfloat16" else (
        __import__("jax.numpy").numpy.bfloat16)
    out_dtype = None if case["out"] is None else np.dtype(case["out"])
    choice = selection.choose_impl(
        case["requested"], case["collective"], case["rows"], case["k"],
        case["n"], dtype, case["axis"], device,
        preferred_element_type=out_dtype, fallback_impl=case["fallback"],
        reduce_scatter_kernel=case["rs_kernel"])
    row = [str(choice.impl), str(choice.backward_impl), choice.reason,
           str(choice.is_fallback)]
    if choice.impl == "pallas":
      coll = Collective.parse(case["collective"], "collective")
      m, k, n = case["rows"], case["k"], case["n"]
      select = (selection.select_config if coll == Collective.ALL_GATHER
                else selection.select_reduce_scatter_config)
      row.append(config_text(select(m, k, n, dtype, case["axis"],
                                    case["cores"], out_dtype=out_dtype)))
      row.append(selection.config_source(m, k, n, dtype, case["axis"],
                                         out_dtype, pattern=coll))
      if choice.backward_impl == "pallas":
        # The backward as the ops chose it: the other kernel, k and n
        # swapped, on the forward's output dtype, writing the operands'.
        bdtype = out_dtype or dtype
        bselect = (selection.select_reduce_scatter_config
                   if coll == Collective.ALL_GATHER
                   else selection.select_config)
        row.append(config_text(bselect(m, n, k, bdtype, case["axis"],
                                       case["cores"], out_dtype=dtype)))
        row.append(selection.config_source(
            m, n, k, bdtype, case["axis"], dtype, pattern=coll.transpose))
    out[key(case)] = "|".join(row)
  return out


PATH = os.path.join(os.path.dirname(__file__), "data",
                    "decisions_before.json.gz")


def main():
  os.environ["XLA_FLAGS"] = "--xla_gpu_enable_command_buffer="
  os.environ["COLLECTIVE_MATMUL_TUNING_CACHE"] = "/nonexistent/tuning.json"
  rows = old_rows()
  with gzip.open(PATH, "wt") as f:
    json.dump(rows, f, sort_keys=True, separators=(",", ":"))
  print(f"{len(rows)} rows -> {PATH}", file=sys.stderr)


if __name__ == "__main__":
  main()


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
    if plan.config is not None:
      row += [config_text(plan.config), plan.source]
    if plan.backward_config is not None:
      row += [config_text(plan.backward_config), plan.backward_source]
    out[key(case)] = "|".join(row)
  return out


def stored_rows():
  with gzip.open(PATH, "rt") as f:
    return json.load(f)
