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
from collective_matmul.kernels import configs

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
  monkeypatch.setattr(selection, "packaged_table", lambda: table)


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
  assert selection.cache_key(m, k, n, dtype, axis_size, kind,
                             pattern) == entry["key"]
  config = selection.packaged_config(m, k, n, dtype, axis_size, kind,
                                     pattern=pattern)
  assert type(config) is {  # pylint: disable=unidiomatic-typecheck
      "all_gather": configs.AllGatherConfig,
      "reduce_scatter": configs.ReduceScatterConfig}[pattern]
  assert config.to_json() == {**type(config)().to_json(), **entry["config"]}
  assert selection.fit_shared_memory(config, dtype) == config
  assert selection.fit_shared_memory(config, dtype, np.float32) is not None
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
  heuristic = select(*problem)
  assert selection.config_source(*problem, pattern=pattern) == "heuristic"
  measured = dataclasses.replace(heuristic, send_gap=heuristic.send_gap + 5)
  tuned = dataclasses.replace(heuristic, send_gap=heuristic.send_gap + 7)
  key = selection.cache_key(*problem, pattern=pattern)  # Local device kind.
  _with_table(monkeypatch, {key: measured})
  assert select(*problem) == measured
  assert selection.config_source(*problem, pattern=pattern) == "packaged table"
  # Another problem, or the other kernel's, is not served by that entry.
  assert select(1024, 4096, 4096, "bfloat16", 4) != measured
  other_kernel = ("reduce_scatter" if pattern == "all_gather"
                  else "all_gather")
  assert selection.config_source(*problem, pattern=other_kernel) == "heuristic"
  selection.store_cached_config(tuned, *problem[:5], pattern=pattern)
  assert select(*problem) == tuned
  assert selection.config_source(*problem, pattern=pattern) == "autotune cache"


def test_a_table_entry_that_does_not_fit_falls_through(monkeypatch):
  problem = (1024, 4096, 4096, "bfloat16", 2)
  heuristic = selection.select_config(*problem)
  # 8 stages of 256 x 256 CTA tiles with k 128: 1 MiB of pipeline.
  huge = configs.AllGatherConfig(tile_m=128, tile_n=256, tile_k=128,
                                 wg_dimension="m", max_concurrent_steps=8)
  assert selection.fit_shared_memory(huge, "bfloat16") is None
  _with_table(monkeypatch, {selection.cache_key(*problem): huge})
  assert selection.select_config(*problem) == heuristic
  assert selection.config_source(*problem) == "heuristic"


def test_a_fitting_table_entry_loses_stages_for_a_float32_output(monkeypatch):
  problem = (1024, 4096, 4096, "bfloat16", 2)
  key = selection.cache_key(*problem, pattern="reduce_scatter")
  entry = selection.select_reduce_scatter_config(*problem)
  _with_table(monkeypatch, {key: entry})
  assert selection.select_reduce_scatter_config(*problem) == entry
  assert selection.select_reduce_scatter_config(
      *problem, out_dtype=np.float32) == selection.fit_shared_memory(
          entry, "bfloat16", np.float32)


def test_the_table_is_read_in_a_multi_process_program_and_the_cache_not(
    monkeypatch):
  problem = (1024, 4096, 4096, "bfloat16", 2)
  heuristic = selection.select_config(*problem)
  measured = dataclasses.replace(heuristic, send_gap=heuristic.send_gap + 5)
  tuned = dataclasses.replace(heuristic, send_gap=heuristic.send_gap + 7)
  other = (2048, 4096, 4096, "bfloat16", 2)
  heuristic_other = selection.select_config(*other)
  selection.store_cached_config(tuned, *problem)
  selection.store_cached_config(
      dataclasses.replace(heuristic_other, send_gap=1), *other)
  _with_table(monkeypatch, {selection.cache_key(*problem): measured})
  assert selection.select_config(*problem) == tuned  # One process: cache.
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert selection.select_config(*problem) == measured
  assert selection.config_source(*problem) == "packaged table"
  assert selection.select_config(*other) == heuristic_other
  assert selection.config_source(*other) == "heuristic"


def test_the_shipped_table_serves_its_device(monkeypatch):
  """On the device kind an entry was measured on, selection picks the
  entry (end to end through the real file)."""
  entry = next(e for e in _raw_table()["entries"]
               if e["key"].startswith("reduce_scatter|"))
  _, kind, dtype, d, shape = entry["key"].split("|")
  m, k, n = map(int, shape.split("x"))
  problem = (m, k, n, dtype, int(d.removeprefix("D=")))
  assert selection.config_source(*problem, pattern="reduce_scatter") == \
      "heuristic"  # On this CPU.
  monkeypatch.setattr(selection, "_local_device_kind", lambda: kind)
  assert selection.config_source(*problem, pattern="reduce_scatter") == \
      "packaged table"
  assert selection.select_reduce_scatter_config(*problem) == \
      configs.ReduceScatterConfig(**entry["config"])
