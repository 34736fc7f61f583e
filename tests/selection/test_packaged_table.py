"""The packaged table of measured configs (`tuned_configs.json`): its
entries, and where it stands in the lookup (explicit config > per-host
autotune cache, single-process only > packaged table > heuristic).
Nothing here needs a GPU.
"""
import dataclasses
import importlib.resources
import json
import os

import jax
import numpy as np
import pytest

from collective_matmul import selection
from collective_matmul.enums import Collective
from collective_matmul.kernels import configs
from collective_matmul.selection import tuned as tuned_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _raw_table():
  return json.loads(importlib.resources.files("collective_matmul").joinpath(
      selection.TUNED_CONFIGS_FILE).read_text())


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
  """Never read (or write) the user's real autotune cache."""
  path = tmp_path / "cache" / "tuning.json"
  monkeypatch.setenv("COLLECTIVE_MATMUL_TUNING_CACHE", str(path))
  return path


@pytest.fixture
def warnings(monkeypatch):
  """The messages of absl warnings logged during the test."""
  from absl import logging
  logged = []
  monkeypatch.setattr(logging, "warning",
                      lambda msg, *args: logged.append(msg % args))
  return logged


def _with_table(monkeypatch, table):
  """Makes `table` ({cache key: config}) the packaged table."""
  monkeypatch.setattr(tuned_lib, "packaged_table", lambda: table)


# The lookups below are for a Hopper GPU (the table's and the cache's keys
# carry its device kind), decided on this CPU.
H200 = selection.DeviceFacts("gpu", "NVIDIA H200", 132)
KIND = H200.device_kind


def _source(problem, pattern="all_gather", out_dtype=None, device=H200):
  """Where `pattern`'s kernel config for `problem` (m, k, n, dtype, D)
  comes from on `device`."""
  m, k, n, dtype, axis_size = problem
  return selection.config_for(
      Collective(pattern),
      selection.Problem(m, k, n, np.dtype(dtype), axis_size, out_dtype),
      device)[1]


# ------------------------------------------------------------- the file


def test_the_file_parses_and_every_entry_builds_its_config(warnings):
  raw = _raw_table()
  assert isinstance(raw["_about"], str) and "autotune.py" in raw["_about"]
  assert raw["entries"], "the packaged table is empty"
  table = selection.parse_tuned_configs(raw)
  assert not warnings, warnings
  assert len(table) == len(raw["entries"])
  assert dict(selection.packaged_table()) == dict(table)


def test_keys_are_unique():
  keys = [entry["key"] for entry in _raw_table()["entries"]]
  assert len(keys) == len(set(keys))


@pytest.mark.parametrize("entry", _raw_table()["entries"],
                         ids=lambda entry: entry["key"])
def test_entry(entry):
  """Key in `cache_key`'s format, config of the key's kernel that fits
  shared memory as it is, a measurement under benchmarks/ as its source."""
  pattern, kind, dtype, d, shape = (
      entry["key"].split("|") if entry["key"].count("|") == 4
      else ["all_gather"] + entry["key"].split("|"))
  m, k, n = map(int, shape.split("x"))
  axis_size = int(d.removeprefix("D="))
  problem = selection.Problem(m, k, n, dtype, axis_size)
  assert selection.cache_key(problem, kind, pattern) == entry["key"]
  config = selection.packaged_config(problem, kind, collective=pattern)
  assert type(config) is {  # pylint: disable=unidiomatic-typecheck
      "all_gather": configs.AllGatherConfig,
      "reduce_scatter": configs.ReduceScatterConfig}[pattern]
  assert config.to_json() == {**type(config)().to_json(), **entry["config"]}
  assert config.fit_shared_memory(*problem.itemsizes) == config
  itemsize = np.dtype(dtype).itemsize
  assert config.fit_shared_memory(itemsize, 4) is not None  # float32 out.
  source = entry["source"]
  assert source.startswith("benchmarks/"), source
  assert os.path.isfile(os.path.join(REPO, source)), source
  assert entry["measured_us"] is None or entry["measured_us"] > 0


def test_the_table_is_package_data():
  setup = open(os.path.join(REPO, "setup.py")).read()
  assert f'"{selection.TUNED_CONFIGS_FILE}"' in setup


# ------------------------------------------------------------- bad entries


def test_a_bad_entry_is_skipped_with_a_warning(warnings):
  good = {"tile_m": 64, "tile_n": 64, "send_gap": 8}
  table = selection.parse_tuned_configs({"_about": "", "entries": [
      {"key": "H100|bfloat16|D=2|1x2x3", "config": good},
      {"key": "H100|bfloat16|D=2|4x5x6",
       "config": {**good, "retired_field": 1}},  # Not a field (any more).
      {"key": "reduce_scatter|H100|bfloat16|D=2|1x2x3",
       "config": {"send_pieces": 3}},  # Invalid for its class.
      {"key": "H100|bfloat16|D=2|7x8x9"},  # No config.
      {"config": good},  # No key.
      {"key": "H100|bfloat16|D=2|1x2x3", "config": good},  # Repeated key.
  ]})
  assert dict(table) == {"H100|bfloat16|D=2|1x2x3":
                         configs.AllGatherConfig(**good)}
  assert len(warnings) == 5, warnings
  assert "retired_field" in warnings[0]
  assert "repeats" in warnings[4]


# A reduce-scatter entry as the table stored it before `grid_minor_dim` and
# `early_announce` were removed (c986a7c), and an all-gather entry naming
# the removed `cluster_dimension` and `sender_announce_lag` at the values
# the kernels now always take.
_OLD_RS_ENTRY = {
    "key": "reduce_scatter|NVIDIA H200|bfloat16|D=2|1024x4096x4096",
    "config": {"tile_m": 128, "tile_n": 128, "tile_k": 64,
               "max_concurrent_steps": 3, "wg_dimension": "n",
               "grid_minor_dim": "m", "grid_tile_width": 8,
               "epi_tile_m": 64, "epi_tile_n": 128, "spread_sends": True,
               "send_gap": 6, "send_pieces": 4, "early_announce": True}}
_OLD_AG_ENTRY = {
    "key": "NVIDIA H200|bfloat16|D=2|8192x4096x5504",
    "config": {"tile_m": 128, "tile_n": 128, "sender_sms": 4,
               "chain_tiles": True, "grid_minor_dim": "m",
               "cluster_dimension": None, "sender_announce_lag": None}}


def test_entries_naming_removed_fields_at_their_values_still_load(
    warnings, monkeypatch):
  """Tables and caches written before a field was removed read as they
  ran: the removed fields are dropped (one logged note, no warning)."""
  notes = []
  monkeypatch.setattr(tuned_lib, "_logged_notes", set())
  monkeypatch.setattr(tuned_lib.logging, "info",
                      lambda msg, *args: notes.append(msg % args))
  table = selection.parse_tuned_configs(
      {"entries": [_OLD_RS_ENTRY, _OLD_AG_ENTRY]})
  assert not warnings
  removed = set(configs.REMOVED_FIELDS)
  assert dict(table) == {
      _OLD_RS_ENTRY["key"]: configs.ReduceScatterConfig(**{
          k: v for k, v in _OLD_RS_ENTRY["config"].items()
          if k not in removed}),
      _OLD_AG_ENTRY["key"]: configs.AllGatherConfig(**{
          k: v for k, v in _OLD_AG_ENTRY["config"].items()
          if k not in removed})}
  assert len(notes) == 2 and all("removed fields" in n for n in notes), notes


@pytest.mark.parametrize("field,value", [
    ("grid_minor_dim", "n"), ("early_announce", False),
    ("cluster_dimension", "m")])
def test_an_entry_naming_a_removed_field_at_another_value_is_skipped(
    warnings, field, value):
  """The kernels no longer run what it measured: skipped, with a warning
  naming the field."""
  entry = dict(_OLD_RS_ENTRY, config={**_OLD_RS_ENTRY["config"],
                                      field: value})
  assert not selection.parse_tuned_configs({"entries": [entry]})
  assert len(warnings) == 1 and f"{field}={value!r}" in warnings[0], warnings


def test_an_unreadable_table_is_empty_with_a_warning(warnings):
  assert not selection.parse_tuned_configs({"entries": "not a list"})
  assert not selection.parse_tuned_configs(["not", "an", "object"])
  assert len(warnings) == 2


# ------------------------------------------------------------- lookup order


@pytest.mark.parametrize("pattern", ["all_gather", "reduce_scatter"])
def test_cache_beats_table_beats_heuristic(monkeypatch, pattern):
  select = {"all_gather": selection.select_config,
            "reduce_scatter": selection.select_reduce_scatter_config}[pattern]
  problem = (1024, 4096, 4096, "bfloat16", 2)
  _with_table(monkeypatch, {})  # The shipped table has H200 entries.
  heuristic = select(*problem, H200)
  assert _source(problem, pattern) == selection.HEURISTIC == "heuristic"
  measured = dataclasses.replace(heuristic, send_gap=heuristic.send_gap + 5)
  tuned = dataclasses.replace(heuristic, send_gap=heuristic.send_gap + 7)
  key = selection.cache_key(selection.Problem(*problem), KIND,
                            collective=pattern)
  _with_table(monkeypatch, {key: measured})
  assert select(*problem, H200) == measured
  assert _source(problem, pattern) == selection.PACKAGED_TABLE == (
      "packaged table")
  # Another problem, the other kernel's, or another device kind is not
  # served by that entry.
  assert select(1024, 4096, 4096, "bfloat16", 4, H200) != measured
  other_kernel = ("reduce_scatter" if pattern == "all_gather"
                  else "all_gather")
  assert _source(problem, other_kernel) == "heuristic"
  assert _source(problem, pattern, device=selection.device_facts()) == (
      "heuristic")  # This CPU.
  selection.store_cached_config(tuned, selection.Problem(*problem), KIND,
                                collective=pattern)
  assert select(*problem, H200) == tuned
  assert _source(problem, pattern) == selection.AUTOTUNE_CACHE == (
      "autotune cache")


def test_a_table_entry_that_does_not_fit_falls_through(monkeypatch):
  problem = (1024, 4096, 4096, "bfloat16", 2)
  heuristic = selection.select_config(*problem, H200)
  # 8 stages of 256 x 256 CTA tiles with k 128: 1 MiB of pipeline.
  huge = configs.AllGatherConfig(tile_m=128, tile_n=256, tile_k=128,
                                 wg_dimension="m", max_concurrent_steps=8)
  assert huge.fit_shared_memory(2, 2) is None  # bf16
  key = selection.cache_key(selection.Problem(*problem), KIND)
  _with_table(monkeypatch, {key: huge})
  assert selection.select_config(*problem, H200) == heuristic
  assert _source(problem) == "heuristic"


def test_a_fitting_table_entry_loses_stages_for_a_float32_output(monkeypatch):
  problem = (1024, 4096, 4096, "bfloat16", 2)
  key = selection.cache_key(selection.Problem(*problem), KIND,
                            collective="reduce_scatter")
  _with_table(monkeypatch, {})
  entry = selection.select_reduce_scatter_config(*problem, H200)
  _with_table(monkeypatch, {key: entry})
  assert selection.select_reduce_scatter_config(*problem, H200) == entry
  assert selection.select_reduce_scatter_config(
      *problem, H200, out_dtype=np.float32) == entry.fit_shared_memory(2, 4)
  assert _source(problem, "reduce_scatter", np.float32) == "packaged table"


def test_the_table_is_read_in_a_multi_process_program_and_the_cache_not(
    monkeypatch):
  problem = (1024, 4096, 4096, "bfloat16", 2)
  heuristic = selection.select_config(*problem, H200)
  measured = dataclasses.replace(heuristic, send_gap=heuristic.send_gap + 5)
  tuned = dataclasses.replace(heuristic, send_gap=heuristic.send_gap + 7)
  other = (2048, 4096, 4096, "bfloat16", 2)
  heuristic_other = selection.select_config(*other, H200)
  selection.store_cached_config(tuned, selection.Problem(*problem), KIND)
  selection.store_cached_config(
      dataclasses.replace(heuristic_other, send_gap=1),
      selection.Problem(*other), KIND)
  key = selection.cache_key(selection.Problem(*problem), KIND)
  _with_table(monkeypatch, {key: measured})
  # One process: cache.
  assert selection.select_config(*problem, H200) == tuned
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert selection.select_config(*problem, H200) == measured
  assert _source(problem) == "packaged table"
  assert selection.select_config(*other, H200) == heuristic_other
  assert _source(other) == "heuristic"


def test_the_shipped_table_serves_its_device(monkeypatch):
  """On the device kind an entry was measured on, selection picks the
  entry (end to end through the real file)."""
  entry = next(e for e in _raw_table()["entries"]
               if e["key"].startswith("reduce_scatter|"))
  _, kind, dtype, d, shape = entry["key"].split("|")
  m, k, n = map(int, shape.split("x"))
  problem = (m, k, n, dtype, int(d.removeprefix("D=")))
  assert _source(problem, "reduce_scatter",
                 device=selection.device_facts()) == "heuristic"  # This CPU.
  # The mesh's device kind, whatever the local device is (the table was
  # once looked up by the local device's kind).
  device = selection.DeviceFacts("gpu", kind, 132)
  assert _source(problem, "reduce_scatter", device=device) == (
      "packaged table")
  assert selection.select_reduce_scatter_config(*problem, device) == \
      configs.ReduceScatterConfig(**entry["config"])
