"""kernels/configs and kernels/schedule: config validation and the ring
schedule the kernels trace, run on CPU arrays (nothing here needs a GPU).
"""
import collections
import itertools
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from collective_matmul.kernels import configs
from collective_matmul.kernels import schedule

Config = configs.AllGatherConfig


# ------------------------------------------------- reduce-scatter send steps

@pytest.mark.parametrize("k_iters", [1, 2, 3, 25, 64, 224])
@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("gap", [1, 12, 24])
def test_partial_send_steps_fall_inside_the_k_loop(k_iters, slots, gap):
  steps = schedule.partial_send_steps(k_iters, slots, gap)
  assert len(steps) == slots
  assert steps[0] == 0 and all(0 <= s < k_iters for s in steps)
  assert steps == sorted(steps)
  if k_iters > 1 and slots > 1:
    # Paced: distinct steps, gap apart when the loop is long enough.
    assert len(set(steps)) == slots
    if k_iters > (slots - 1) * gap:
      assert steps[1] - steps[0] == gap


@pytest.mark.parametrize("k_iters", [1, 2, 25, 49, 64, 224])
@pytest.mark.parametrize("deferred", [True, False])
def test_partial_announce_step_follows_the_last_send(k_iters, deferred):
  gap, slots = 24, 2
  step = schedule.partial_announce_step(k_iters, slots, gap, deferred)
  last_send = schedule.partial_send_steps(k_iters, slots, gap)[-1]
  if step is None:  # Announced after the loop: no step gap after the sends.
    assert (last_send if deferred else 0) + gap >= k_iters
  else:
    assert 0 < step < k_iters
    assert step - (last_send if deferred else 0) == gap


@pytest.mark.parametrize("pieces", [0, 3, 16])
def test_send_pieces_must_split_the_epilogue_rows_in_multiples_of_8(pieces):
  with pytest.raises(ValueError, match="send_pieces"):
    configs.ReduceScatterConfig(epi_tile_m=64, send_pieces=pieces)


def test_reduce_scatter_announce_at_the_seed_shape():
  # 64 k steps of 64: sends at 0 and 24, announce at 48.
  assert schedule.partial_announce_step(64, 2, 24, True) == 48


# ------------------------------------------------------- config arithmetic


def test_smem_bytes_counts_pipeline_and_epilogue():
  config = Config(tile_m=128, tile_n=64, tile_k=64, max_concurrent_steps=3,
                  wg_dimension="m")
  pipeline = 3 * 64 * (256 + 64) * 2
  epilogue = 4 * 64 * 64 * 4
  assert config.smem_bytes(2, 4) == pipeline + epilogue + configs.SMEM_RESERVE


@pytest.mark.parametrize("wg", ["m", "n"])
def test_cta_tile_doubles_along_warpgroup_dimension(wg):
  config = Config(tile_m=64, tile_n=128, wg_dimension=wg)
  assert config.cta_tile_m == 64 * (2 if wg == "m" else 1)
  assert config.cta_tile_n == 128 * (2 if wg == "n" else 1)


# ------------------------------------------------------------------ padding


@pytest.mark.parametrize("config", [Config(), Config(wg_dimension="m"),
                                    Config(tile_m=64, tile_n=64, tile_k=32)])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (100, 70, 300), (128, 64, 256),
                                   (129, 65, 257), (4096, 4096, 4096)])
def test_padding_rounds_up_to_the_tiles(config, m, k, n):
  pad = schedule.padding(config, m, k, n)
  for size, extra, tile in ((m, pad.m, config.cta_tile_m),
                            (k, pad.k, config.tile_k),
                            (n, pad.n, config.cta_tile_n)):
    assert 0 <= extra < tile
    assert (size + extra) % tile == 0
  assert pad.any == (m % config.cta_tile_m != 0 or k % config.tile_k != 0
                     or n % config.cta_tile_n != 0)


# ----------------------------------------------------- the ring's k schedule

SCHEDULES = list(itertools.product(
    (1, 2, 3, 4, 5, 8, 16, 17, 64),  # k_iters
    (1, 2, 3, 4, 7, 8, 20, 70),  # n_iters (more than k_iters included)
    (1, 2, 3, 4, 16),  # requested send_gap
))


# One grid shape for every case (sliced after), so eager ops compile once.
_MAX_K = max(c[0] for c in SCHEDULES)
_MAX_N = max(c[1] for c in SCHEDULES)
_KK, _N_IDX = np.meshgrid(np.arange(_MAX_K, dtype=np.int32),
                          np.arange(_MAX_N, dtype=np.int32))


def _schedule(k_iters, n_iters, spread, gap):
  per, senders, gap = schedule.send_plan(k_iters, n_iters, spread, gap)
  scalar = lambda v: jnp.asarray(v, jnp.int32)
  blocks = np.asarray(schedule.k_block(
      jnp.asarray(_KK), jnp.asarray(_N_IDX), scalar(k_iters), scalar(per),
      scalar(gap)))[:n_iters, :k_iters]
  share = np.asarray(schedule.sender_share(
      jnp.arange(_MAX_N, dtype=jnp.int32), scalar(k_iters),
      scalar(per)))[:n_iters]
  sends_now = np.asarray(schedule.is_send_step(
      jnp.asarray(_KK), jnp.asarray(_N_IDX), scalar(k_iters), scalar(per),
      scalar(gap)))[:n_iters, :k_iters]
  kk, n_idx = _KK[:n_iters, :k_iters], _N_IDX[:n_iters, :k_iters]
  return per, senders, gap, kk, n_idx, blocks, share, sends_now


@pytest.mark.parametrize("spread", [True, False], ids=["spread", "seed"])
def test_k_block_is_a_permutation_and_sends_cover_k_once(spread):
  for k_iters, n_iters, requested_gap in SCHEDULES:
    case = (k_iters, n_iters, requested_gap)
    per, senders, gap, kk, n_idx, blocks, share, sends_now = _schedule(
        k_iters, n_iters, spread, requested_gap)
    assert 1 <= gap <= max(requested_gap, 1), case
    # Every n-tile's pipeline visits each k block exactly once.
    for row in blocks:
      assert sorted(row.tolist()) == list(range(k_iters)), (case, row)
    # Senders are the first `senders` n-tiles, and all of them exist.
    assert 1 <= senders <= n_iters, case
    assert ((share > 0) == (np.arange(n_iters) < senders)).all(), case
    assert share.sum() == k_iters, case
    # The blocks sent (at steps 0, gap, 2 gap, ... < share) cover k once.
    sent = sorted(blocks[sends_now].tolist())
    assert sent == list(range(k_iters)), (case, sent)
    # Every send happens inside the pipeline, the last at last_send_step.
    last = np.asarray(schedule.last_send_step(
        jnp.arange(_MAX_N, dtype=jnp.int32), jnp.int32(k_iters),
        jnp.int32(per), jnp.int32(gap)))[:n_iters]
    last_seen = np.where(sends_now, kk, -1).max(axis=1)
    senders_mask = share > 0
    np.testing.assert_array_equal(last[senders_mask],
                                  last_seen[senders_mask], err_msg=str(case))
    assert (last_seen < k_iters).all(), case
    assert (last[~senders_mask] < 0).all(), case
    assert not sends_now[~senders_mask].any(), case
    if not spread:
      assert (per, senders, gap) == (k_iters, 1, 1)
      assert (blocks[0] == np.arange(k_iters)).all()


def test_spread_sends_start_each_slice_early():
  """With spread, every sender's first step loads its own first block."""
  for k_iters, n_iters, gap in SCHEDULES:
    per, senders, gap, _, _, blocks, _, _ = _schedule(k_iters, n_iters,
                                                      True, gap)
    assert per == math.ceil(k_iters / n_iters)
    for j in range(senders):
      assert blocks[j, 0] == j * per


def test_tile_coordinates_orders_steps_outermost():
  for axis_size, m_iters, n_iters in ((1, 1, 1), (2, 3, 5), (8, 4, 2)):
    linear = jnp.arange(axis_size * m_iters * n_iters, dtype=jnp.int32)
    step, in_step = map(np.asarray, schedule.tile_coordinates(
        linear, m_iters, n_iters))
    np.testing.assert_array_equal(step * m_iters * n_iters + in_step, linear)
    assert (0 <= in_step).all() and (in_step < m_iters * n_iters).all()
    assert (np.diff(step) >= 0).all() and step.max() == axis_size - 1


def test_source_device_visits_every_shard_once():
  for axis_size in (1, 2, 3, 4, 8):
    dev = jnp.arange(axis_size, dtype=jnp.int32)
    seen = np.stack([np.asarray(schedule.source_device(
        dev, jnp.full_like(dev, s), axis_size)) for s in range(axis_size)])
    for row in list(seen) + list(seen.T):  # Per step and per device.
      assert sorted(row.tolist()) == list(range(axis_size))
    np.testing.assert_array_equal(seen[0], np.arange(axis_size))


@pytest.mark.parametrize("k_major", [False, True])
@pytest.mark.parametrize("k_iters,sender_sms", [(64, 4), (64, 3), (8, 16),
                                                 (1, 4), (16, 1), (10, 4)])
@pytest.mark.parametrize("m_iters,axis_size", [(8, 2), (3, 4), (1, 2)])
def test_sender_blocks_forward_every_chunk_once_and_announce_every_unit(
    k_iters, sender_sms, m_iters, axis_size, k_major):
  """The sender blocks' copy loops together forward every (ring step, row
  block, k block) exactly once, steps in order. By rows each goes row block
  by row block; k-major, k group by k group. Every arrival unit is opened
  and closed once per sender with chunks in it, in the order the units
  are waited for, and gets exactly the signals it waits for."""
  plan = schedule.SenderPlan(k_iters, m_iters, sender_sms, k_major)
  seen = []
  signals = collections.Counter()
  for sender in map(jnp.int32, range(sender_sms)):
    order, opened = [], []
    for c in range((axis_size - 1) * int(plan.chunks_per_step(sender))):
      step, i, j = (int(v) for v in plan.chunk(jnp.int32(c), sender))
      assert 0 <= j < int(plan.share(sender)) and 0 <= i < m_iters
      kb = int(plan.k_block(sender, jnp.int32(j)))
      unit = int(plan.unit(i, j))
      # A k-major unit is a k group: blocks [unit * S, (unit + 1) * S).
      assert unit == (kb // sender_sms if k_major else i)
      seen.append((step, i, kb))
      order.append((step, unit))
      if bool(plan.opens_unit(sender, i, j)):
        opened.append((step, unit))
      if bool(plan.closes_unit(sender, i, j)):
        assert opened[-1] == (step, unit)
        signals[step, unit] += 1
    assert order == sorted(order)
    assert len(opened) == len(set(opened))
  assert sorted(seen) == [(s, i, kb) for s in range(axis_size - 1)
                          for i in range(m_iters) for kb in range(k_iters)]
  units = {(step, kb // sender_sms if k_major else i)
           for step, i, kb in seen}
  assert set(signals) == units
  assert plan.num_units == 1 + max(u for _, u in units)
  for (_, unit), count in signals.items():
    assert count == int(plan.unit_signals(jnp.int32(unit)))


def test_k_major_groups_are_the_pipelines_k_order():
  """A k-major tile waits for group kk // S at pipeline steps kk that are
  multiples of S, loading k blocks in order: so group g must be exactly k
  blocks [g * S, (g + 1) * S)."""
  k_iters, sender_sms = 10, 4
  plan = schedule.SenderPlan(k_iters, 2, sender_sms, True)
  groups = collections.defaultdict(set)
  for sender in range(sender_sms):
    for j in range(int(plan.share(jnp.int32(sender)))):
      groups[j].add(int(plan.k_block(jnp.int32(sender), jnp.int32(j))))
  assert [sorted(groups[g]) for g in sorted(groups)] == [
      [0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("k_major,expected", [(True, 0), (False, 16)])
def test_sender_announce_lag(k_major, expected):
  """K-major units are announced as soon as their stores landed; by rows
  twice the stores in flight late (so announcing drains none)."""
  plan = schedule.SenderPlan(64, 8, 4, k_major)
  assert plan.announce_lag(8) == expected


@pytest.mark.parametrize("slots", [2, 3, 7, 12])
def test_sender_pipeline_never_loads_over_an_unread_store(slots):
  """Replays the copy loop's order: chunk c is stored at iteration c; after
  the wait (at most `in_flight` stores unread) chunk c + ahead is loaded
  into slot (c + ahead) % slots. No load may hit a slot whose store is
  still unread, or a slot not yet stored from; an announce waits only for
  stores at least `lag` old."""
  ahead, in_flight = schedule.sender_pipeline(slots)
  assert ahead >= 1 and in_flight >= 1 and ahead + in_flight == slots
  n = 50
  holder = {c % slots: c for c in range(ahead)}  # Slot -> chunk loaded.
  for c in range(n):
    assert holder[c % slots] == c  # Its load went to its own slot.
    stored_unread = set(range(max(0, c - in_flight + 1), c + 1))
    if c + ahead < n:
      previous = holder.get((c + ahead) % slots)
      assert previous is None or (previous < c - in_flight + 1
                                  and previous not in stored_unread)
      holder[(c + ahead) % slots] = c + ahead


def test_sender_slots_fit_shared_memory():
  for config in (Config(sender_sms=4), Config(tile_m=128, wg_dimension="m",
                                              tile_k=128, sender_sms=4)):
    slots = config.sender_slots(2)
    assert 2 <= slots <= configs.MAX_SENDER_SLOTS
    assert slots * config.sender_chunk_elems * 2 <= (
        configs.SMEM_BYTES - configs.SMEM_RESERVE)


# --------------------------------------------------------- config validation


@pytest.mark.parametrize("field,value", [
    ("tile_m", 96), ("tile_m", 0), ("tile_n", -64), ("epi_tile_m", 32),
    ("epi_tile_n", 100), ("tile_k", 48), ("tile_k", 256),
    ("max_concurrent_steps", 1), ("wg_dimension", "k"),
    ("send_gap", 0), ("grid_tile_width", 0),
    ("sender_sms", -1),
])
def test_kernel_config_validation_names_the_field(field, value):
  with pytest.raises(ValueError, match=f"{field}="):
    Config(**{field: value})


def test_k_major_sends_need_sender_blocks():
  with pytest.raises(ValueError, match="k_major_sends=True needs sender_sms"):
    Config(k_major_sends=True)
  assert Config(sender_sms=4, k_major_sends=True).k_major_sends




def test_kernel_config_epilogue_must_divide_tile():
  with pytest.raises(ValueError, match="epilogue tile"):
    Config(tile_m=64, epi_tile_m=128)


def test_kernel_config_json_roundtrip():
  config = Config(tile_m=64, wg_dimension="m", send_gap=3)
  assert Config(**json.loads(json.dumps(config.to_json()))) == config
