"""The autotune cache is read like input: a damaged entry is a miss with
one log line naming why, never a hang, an exception or a silently
misread value; storing over a damaged file keeps the sweep's result."""
import dataclasses
import json
import time

from absl import logging
import jax.numpy as jnp
import pytest

from collective_matmul import selection
from collective_matmul.enums import Collective
from collective_matmul.selection import tuned

H200 = selection.DeviceFacts("gpu", "NVIDIA H200", 132)
PROBLEM = selection.Problem(1024, 4096, 4096, jnp.bfloat16, 2)
KEY = selection.cache_key(PROBLEM, H200.device_kind)
GOOD = selection.AllGatherConfig(tile_m=128, tile_n=128).to_json()


@pytest.fixture
def cache(tmp_path, monkeypatch):
  path = tmp_path / "tuning.json"
  monkeypatch.setenv("COLLECTIVE_MATMUL_TUNING_CACHE", str(path))
  tuned._logged_misses.clear()  # pylint: disable=protected-access
  return path


@pytest.fixture
def warnings(monkeypatch):
  lines = []
  monkeypatch.setattr(logging, "warning",
                      lambda msg, *args: lines.append(msg % args))
  return lines


def _entry(**fields):
  return dict(GOOD, **fields)


DAMAGED_ENTRIES = {
    "huge stages": (_entry(max_concurrent_steps=1_000_000_000), "more than"),
    "float stages": (_entry(max_concurrent_steps=4.0), "must be of type"),
    "float tile": (_entry(tile_m=128.0), "must be of type"),
    "string bool": (_entry(chain_tiles="no"), "must be of type"),
    "int bool": (_entry(chain_tiles=1), "must be of type"),
    "bool int": (_entry(tile_m=True), "must be of type"),
    "null int": (_entry(send_gap=None), "must be of type"),
    "unknown field": (_entry(warp_magic=3), "no field"),
    "bad value": (_entry(tile_m=100), "multiple of 64"),
    "bad choice": (_entry(wg_dimension="k"), "wg_dimension"),
    "not an object": (4.0, "not a JSON object"),
    "a list": ([1, 2], "not a JSON object"),
    "a string": ("128x128", "not a JSON object"),
    "reduce-scatter field": (_entry(send_pieces=2), "no field"),
    "int choice": (_entry(wg_dimension=3), "must be of type"),
    "pingpong in a ring": (_entry(chain_tiles=True, pingpong=True),
                           "needs eager_release=True"),
    "removed field, other value": (_entry(grid_minor_dim="n"),
                                   "grid_minor_dim='n': the field was "
                                   "removed"),
    "removed cluster": (_entry(cluster_dimension="m"), "was removed"),
    "huge send gap": (_entry(send_gap=10**12), "more than"),
    "huge sender count": (_entry(sender_sms=10**6), "more than"),
    "huge tile": (_entry(tile_n=10**9), "more than"),
    "huge epilogue tile": (_entry(epi_tile_n=2**40), "more than"),
    "huge grid width": (_entry(grid_tile_width=10**9), "more than"),
    "sender count of a GPU": (_entry(sender_sms=132), "more than"),
}


@pytest.mark.parametrize("name", sorted(DAMAGED_ENTRIES))
def test_a_damaged_entry_is_a_logged_miss(cache, warnings, name):
  entry, why = DAMAGED_ENTRIES[name]
  cache.write_text(json.dumps({KEY: entry}))
  start = time.monotonic()
  assert selection.load_cached_config(PROBLEM, H200.device_kind) is None
  assert time.monotonic() - start < 1
  assert len(warnings) == 1 and why in warnings[0], warnings
  assert KEY in warnings[0]
  # The decision falls back to the packaged table or the heuristics.
  config, source = selection.config_for(
      Collective.ALL_GATHER, PROBLEM, H200)
  assert source != selection.AUTOTUNE_CACHE and config is not None


DAMAGED_FILES = {
    "not JSON": ("{not json", "JSONDecodeError"),
    "deep nesting": ("[" * 100000 + "]" * 100000, "RecursionError"),
    "a number": ("4.0", "not a JSON object"),
    "binary": (b"\xff\xfe\x00garbage", "UnicodeDecodeError"),
}


@pytest.mark.parametrize("name", sorted(DAMAGED_FILES))
def test_a_damaged_file_is_a_logged_miss_and_stored_over(cache, warnings,
                                                        name):
  content, why = DAMAGED_FILES[name]
  (cache.write_bytes if isinstance(content, bytes) else cache.write_text)(
      content)
  assert selection.load_cached_config(PROBLEM, H200.device_kind) is None
  assert len(warnings) == 1 and why in warnings[0], warnings
  config = selection.AllGatherConfig(tile_m=64, tile_n=128)
  selection.store_cached_config(config, PROBLEM, H200.device_kind)
  assert selection.load_cached_config(PROBLEM, H200.device_kind) == config
  aside = list(cache.parent.glob("tuning.json.damaged-*"))
  assert len(aside) == 1 and aside[0].read_bytes() == (
      content if isinstance(content, bytes) else content.encode())
  assert any("moved to" in line for line in warnings)


def test_every_integer_field_is_bounded():
  """A stored integer field without an upper bound would let residue such
  as `send_gap: 10**12` into a kernel config."""
  for cls in tuned.CONFIG_CLASSES.values():
    for field in dataclasses.fields(cls):
      if int in tuned._FIELD_TYPES[str(field.type)]:  # pylint: disable=protected-access
        assert field.name in tuned.FIELD_LIMITS, (cls, field.name)


def test_an_entry_at_the_bounds_is_read(cache, warnings):
  """The bounds refuse residue, not configs."""
  entry = _entry(send_gap=tuned.FIELD_LIMITS["send_gap"],
                 grid_tile_width=tuned.FIELD_LIMITS["grid_tile_width"])
  cache.write_text(json.dumps({KEY: entry}))
  assert selection.load_cached_config(
      PROBLEM, H200.device_kind) == selection.AllGatherConfig(**entry)
  assert not warnings


def test_an_entry_too_large_for_shared_memory_is_a_logged_miss(
    cache, warnings, rng):
  side = 64 * int(rng.integers(8, 16))
  entry = _entry(tile_m=side, tile_n=side, max_concurrent_steps=2)
  cache.write_text(json.dumps({KEY: entry}))
  config, source = selection.config_for(
      Collective.ALL_GATHER, PROBLEM, H200)
  assert source != selection.AUTOTUNE_CACHE and config is not None
  assert len(warnings) == 1 and "shared memory" in warnings[0], warnings
  assert KEY in warnings[0]


def test_each_miss_is_logged_once(cache, warnings):
  cache.write_text(json.dumps({KEY: _entry(tile_m=128.0)}))
  for _ in range(3):
    selection.load_cached_config(PROBLEM, H200.device_kind)
  assert len(warnings) == 1


def test_a_good_entry_is_read(cache, warnings):
  cache.write_text(json.dumps({KEY: GOOD}))
  assert selection.load_cached_config(
      PROBLEM, H200.device_kind) == selection.AllGatherConfig(**GOOD)
  assert not warnings


def test_every_declared_field_type_has_a_reader():
  """A config field of a type the reader does not know would raise (a
  KeyError) instead of being a logged miss."""
  for cls in tuned.CONFIG_CLASSES.values():
    for field in dataclasses.fields(cls):
      assert str(field.type) in tuned._FIELD_TYPES, (cls, field)  # pylint: disable=protected-access


def test_a_cached_entry_naming_removed_fields_is_read_as_it_ran(
    cache, warnings):
  """A cache written before `cluster_dimension`, `grid_minor_dim` and
  `sender_announce_lag` were removed, at the values the kernels now always
  take: the entry serves, without them."""
  entry = _entry(sender_sms=4, k_major_sends=True, cluster_dimension=None,
                 grid_minor_dim="m", sender_announce_lag=None)
  cache.write_text(json.dumps({KEY: entry}))
  assert selection.load_cached_config(
      PROBLEM, H200.device_kind) == selection.AllGatherConfig(
          **_entry(sender_sms=4, k_major_sends=True))
  assert not warnings


def test_an_entry_with_the_later_fields_is_read(cache, warnings):
  entry = _entry(epi_slots=1, epi_tile_m=128, epi_tile_n=128)
  cache.write_text(json.dumps({KEY: entry}))
  assert selection.load_cached_config(
      PROBLEM, H200.device_kind) == selection.AllGatherConfig(**entry)
  assert not warnings
