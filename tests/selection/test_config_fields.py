"""Every kernel config field is picked by something the product runs: the
heuristics (`selection.heuristic_config`), autotuning's candidate space
(`autotuning.candidate_configs`) or the packaged table
(`tuned_configs.json`). A field that none of them ever sets to anything
but its default is a knob nothing turns; it goes, or it is named below
with the reason it stays.

What each source picks is computed from the code: the heuristics and the
candidates over a grid of problems (the decision grid's sizes, every dtype
the kernels take, D = 1, 2, 4, 8, two Hopper SM counts), the table as
packaged.
"""
import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from collective_matmul import autotuning
from collective_matmul import selection
from collective_matmul.enums import Collective
from collective_matmul.kernels import configs

# Fields that stay although nothing picks them, each with why: none.
# (Ping-pong warpgroups, the whole-tile one-slot epilogue's 128-row
# `epi_tile_m` and the all-gather's unspread sends are autotuning
# candidates, `autotuning._pingpong_candidates`.)
NOT_PICKED: dict[str, str] = {}

H200 = selection.DeviceFacts("gpu", "NVIDIA H200", 132)
H100_PCIE = selection.DeviceFacts("gpu", "NVIDIA H100 PCIe", 114)
BF16, F16, F32 = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16),
                  np.dtype(jnp.float32))
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
# (lhs, rhs, result) dtypes: 16-bit with their own or f32 results, and
# both fp8 pairs with bf16 or f32 results.
DTYPES = [(BF16, None, None), (BF16, None, F32), (F16, None, None),
          (E4M3, None, BF16), (E4M3, None, F32), (E5M2, E4M3, BF16)]
ROWS = (64, 128, 256, 512, 1024, 4096, 8192)
KS = (1024, 4096, 5504, 14336)
NS = (1024, 2048, 4096, 5504, 11008)
AXES = (1, 2, 4, 8)
# Autotuning's candidates, over fewer problems (each lists dozens).
TUNED_PROBLEMS = [((512, 4096, 4096), 2), ((1024, 4096, 4096), 2),
                  ((8192, 4096, 5504), 2), ((4096, 7168, 8192), 4),
                  ((128, 4096, 2048), 1)]
CLASSES = (configs.AllGatherConfig, configs.ReduceScatterConfig)


@pytest.fixture(autouse=True)
def _no_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("COLLECTIVE_MATMUL_TUNING_CACHE",
                     str(tmp_path / "tuning.json"))


def _problems(rows=ROWS, ks=KS, ns=NS, axes=AXES):
  for m, k, n, d, (lhs, rhs, out) in itertools.product(rows, ks, ns, axes,
                                                        DTYPES):
    yield selection.Problem(m, k, n, lhs, d, out, rhs)


def _heuristic_picks():
  for problem, device, collective in itertools.product(
      _problems(), (H200, H100_PCIE), Collective):
    yield selection.heuristic_config(collective, problem, device)


def _candidates():
  for ((m, k, n), d), (lhs, rhs, out), collective in itertools.product(
      TUNED_PROBLEMS, DTYPES, Collective):
    yield from autotuning.candidate_configs(
        collective, selection.Problem(m, k, n, lhs, d, out, rhs), H200)


def _non_default_fields(picks):
  """{(config class, field name)} of the fields some pick holds at other
  than its class's default."""
  found = set()
  for config in picks:
    default = type(config)()
    for field in dataclasses.fields(config):
      if getattr(config, field.name) != getattr(default, field.name):
        found.add((type(config), field.name))
  return found


def _owner(cls, name):
  """Where a field is declared: a `TileConfig` field is one knob of the
  skeleton both kernels share, picked if picked for either."""
  tile_fields = {f.name for f in dataclasses.fields(configs.TileConfig)}
  return "TileConfig" if name in tile_fields else cls.__name__


@pytest.fixture(scope="module")
def picked():
  """{"TileConfig.x" / "AllGatherConfig.y": sources that pick it}."""
  sources = {"heuristics": _heuristic_picks(),
             "autotuning": _candidates(),
             "packaged table": selection.packaged_table().values()}
  out = {}
  for source, picks in sources.items():
    for cls, name in _non_default_fields(picks):
      out.setdefault(f"{_owner(cls, name)}.{name}", set()).add(source)
  return out


def _all_fields():
  return sorted({f"{_owner(cls, f.name)}.{f.name}"
                 for cls in CLASSES for f in dataclasses.fields(cls)})


def _allowed(qualified):
  return qualified in NOT_PICKED or qualified.split(".")[1] in NOT_PICKED


@pytest.mark.parametrize("field", _all_fields())
def test_every_config_field_is_picked_by_selection_autotuning_or_the_table(
    picked, field):
  if _allowed(field):
    assert field not in picked, (
        f"{field} is picked by {sorted(picked[field])}: take it off "
        "NOT_PICKED")
    return
  assert field in picked, (
      f"{field}: no heuristic pick, autotune candidate or packaged table "
      "entry sets it; remove it (configs.REMOVED_FIELDS keeps stored "
      "entries readable) or say in NOT_PICKED why it stays")


def test_the_allow_list_names_fields_that_exist():
  names = {f.name for cls in CLASSES for f in dataclasses.fields(cls)}
  for entry in NOT_PICKED:
    assert entry.split(".")[-1] in names, entry


def test_removed_fields_are_gone():
  """`configs.REMOVED_FIELDS` is what stored entries may still name; none
  of it is a field any more."""
  names = {f.name for cls in CLASSES for f in dataclasses.fields(cls)}
  assert not names & set(configs.REMOVED_FIELDS)
