"""The selection redesign kept every decision and config: 72576 cases
(`decision_grid`) as the code before it (d8888bb) computed them, against
`selection.choose` today.

Two rules changed on purpose, and the cases they flip are checked to be
exactly those:
* the backward's small-problem test counts the tiles of the config that
  kernel would run (the reduce-scatter backward of an all-gather counted
  the all-gather kernel's tiles);
* an explicit `pallas` runs the kernel in the backward too where it can,
  small problems included, as it always did in the forward (the backward
  went to XLA's there).

Heuristic rules added since (bf16's one-slot wide tiles, ping-pong tiles) are applied to the stored
configs before the comparison (`decision_grid.with_later_rules`), so the
grid still pins every other decision and config.
"""
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from collective_matmul import selection
from collective_matmul.enums import Collective

sys.path.insert(0, os.path.dirname(__file__))
import decision_grid  # pylint: disable=wrong-import-position


@pytest.fixture(autouse=True)
def _no_cache_command_buffers_off(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  monkeypatch.setenv("COLLECTIVE_MATMUL_TUNING_CACHE",
                     "/nonexistent/tuning.json")


def _backward_verdicts(case):
  """(too small counting the backward kernel's own tiles, too small counting
  the all-gather kernel's tiles: the old rule)."""
  device = selection.DeviceFacts(case["platform"], case["kind"],
                                 case["cores"])
  dtype = np.dtype(jnp.bfloat16 if case["dtype"] == "bfloat16"
                   else case["dtype"])
  back = selection.Problem(case["rows"], case["k"], case["n"], dtype,
                           case["axis"]).backward()
  collective = Collective(case["collective"]).transpose
  own = selection.config_for(collective, back, device)[0]
  other = selection.config_for(Collective.ALL_GATHER, back, device)[0]
  too_small = lambda c: selection.too_small_reason(
      c, back, device.num_cores) is not None
  return too_small(own), too_small(other)


def test_every_decision_and_config_is_as_before_the_redesign():
  before = decision_grid.stored_rows()
  now = decision_grid.new_rows()
  assert before.keys() == now.keys()
  changed = [key for key in before if before[key] != now[key]]
  assert len(changed) < len(before) // 20, changed[:5]
  cases = {decision_grid.key(c): c for c in decision_grid.cases()}
  for key in changed:
    old, new = before[key].split("|"), now[key].split("|")
    case = cases[key]
    # Only the backward changed, from XLA's to the kernel, the forward not.
    assert (old[1], new[1]) == ("baseline", "pallas"), key
    assert old[0] == new[0] and old[2:6] == new[2:6], key
    own_small, old_small = _backward_verdicts(case)
    if case["requested"] == "pallas" and own_small:
      continue  # Explicit pallas now runs a small backward too.
    # Else the old rule counted the all-gather kernel's tiles.
    assert case["collective"] == "all_gather", key
    assert old_small and not own_small, key


def test_the_grid_covers_every_outcome():
  """A grid that missed a branch would pin nothing there."""
  rows = decision_grid.stored_rows().values()
  outcomes = {tuple(r.split("|")[:2]) for r in rows}
  assert outcomes >= {("pallas", "pallas"), ("pallas", "baseline"),
                      ("pallas", "ring"), ("baseline", "baseline"),
                      ("ring", "ring")}
  sources = {r.split("|")[5] for r in rows if r.startswith("pallas")}
  assert sources == {"heuristic", "packaged table"}
