"""tools/rings_one_gpu.py without a GPU: its cases cover what the rings'
check must (D = 2, 4, 8; both kernels; bf16 and both fp8 pairs; skew;
a dropped wait and a dropped signal per kernel), their programs trace
(and lower for CUDA on JAX >= 0.12), the runner reports a hang or a dead
worker as a failure instead of hanging, and the kernels reach their peers
only through `kernels.peers`."""
import json
import os
import pathlib
import re
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                "tools"))
import rings_one_gpu as rings  # pylint: disable=g-import-not-at-top,wrong-import-position

from collective_matmul.kernels import peers  # pylint: disable=g-import-not-at-top,wrong-import-position

_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
KERNELS = pathlib.Path(__file__).parents[2] / "plugin/collective_matmul/kernels"


def test_the_cases_cover_the_rings():
  cases = rings.cases()
  assert len({c.name for c in cases}) == len(cases)
  for kind in ("all_gather", "reduce_scatter"):
    mine = [c for c in cases if c.kind == kind]
    assert {c.d for c in mine} == {2, 4, 8}
    assert {c.dtypes for c in mine} == {"bf16", "fp8"}
    assert any(c.shares and len(set(c.shares)) > 1 for c in mine)
    assert any(any(c.delay_ns) and not c.expect_fail for c in mine)
    dropped = {site for c in mine if c.expect_fail for site in c.drop}
    assert any("wait" in s for s in dropped), dropped
    assert any("signal" in s for s in dropped), dropped
    assert any(c.early_free and c.expect_fail for c in mine)  # de65204.
    assert any(c.config.chain_tiles for c in mine)
    assert any(c.origin.startswith("selection") for c in mine)
    assert any(c.m % 128 or c.k % 128 for c in mine)  # Off the tiles.
  senders = [c.config.sender_sms for c in cases if c.kind == "all_gather"]
  assert 0 in senders and any(senders)
  for c in cases:
    assert sum(c.ranks().shares) <= rings.SM_COUNT


def test_the_rowwise_cases_cover_both_kernels_at_every_d():
  rowwise = [c for c in rings.cases() if "/rowwise/" in c.name]
  for kind in ("all_gather", "reduce_scatter"):
    mine = [c for c in rowwise if c.kind == kind]
    assert {c.d for c in mine} == {2, 4, 8}
    assert {c.dtypes for c in mine} == {"fp8"}
    given = {c.scale_names() for c in mine}
    assert {("row_scale",), ("col_scale",), rings.ROWWISE} <= given
    assert any("scale" in names for names in given)
    assert any(c.config.pingpong for c in mine)
    assert any(c.config.epi_slots == 1 and c.config.tile_n == 256
               for c in mine)
    assert any(c.origin.startswith("rowwise, selection") for c in mine)
    assert any(c.m % 128 for c in mine)  # Off the tiles.
    assert any(c.first_tile_scales and c.expect_fail for c in mine)
  listed = rings.main(["--list", "--only", "/rowwise/"])
  assert listed == 0


def _rowwise_by_hand(kind, d, a, b_nk, row, col):
  """Each rank's rowwise product, block by block in float64: the
  all-gather's shard j rows times rank r's columns, scaled by shard j's
  row scales and rank r's column scales; the reduce-scatter's sum over
  ranks r of rank r's scaled partial product, rank i keeping block i."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  a, b_nk, row, col = (np.asarray(x, np.float64) for x in (a, b_nk, row, col))
  if kind == "all_gather":
    return np.stack([np.concatenate(
        [(a[j] @ b_nk[r].T) * row[j][:, None] * col[r][None, :]
         for j in range(d)]) for r in range(d)])
  total = sum((a[r] @ b_nk[r].T) * row[r][:, None] * col[r][None, :]
              for r in range(d))
  return total.reshape(d, -1, total.shape[-1])


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_the_rowwise_reference_scales_each_ranks_rows_and_columns(kind):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from collective_matmul import kernels  # pylint: disable=g-import-not-at-top
  config = (kernels.AllGatherConfig if kind == "all_gather" else
            kernels.ReduceScatterConfig)(tile_k=128)
  case = rings.Case("small", kind, 3, 16, 32, 24, "fp8", config,
                    scales=rings.ROWWISE)
  _, specs, reference = rings._program(case)  # pylint: disable=protected-access
  args = rings._operands(specs, seed=1)  # pylint: disable=protected-access
  row, col = np.asarray(args[2]), np.asarray(args[3])
  assert row.min() > 0 and row.std() > 0.5 and col.std() > 0.5
  want = _rowwise_by_hand(kind, 3, *args)
  got = np.asarray(reference(*args), np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)
  assert not np.allclose(got, _rowwise_by_hand(kind, 3, *args[:2], row,
                                               jnp.ones_like(col)))


def test_the_first_tile_scales_mutation_changes_the_traced_epilogue():
  case = next(c for c in rings.cases() if c.first_tile_scales)
  fn, specs, _ = rings._program(case)  # pylint: disable=protected-access
  with rings._mutations(case):  # pylint: disable=protected-access
    mutated = str(fn.trace(*specs).jaxpr)
  fn, specs, _ = rings._program(case)  # pylint: disable=protected-access
  assert str(fn.trace(*specs).jaxpr) != mutated


def test_virtual_ranks_refuse_what_cannot_run():
  with pytest.raises(ValueError, match="one positive block count per rank"):
    peers.VirtualRanks(2, (66,))
  with pytest.raises(ValueError, match=">= 2 ranks"):
    peers.VirtualRanks(1, (66,))
  with pytest.raises(ValueError, match="not among"):
    peers.VirtualRanks(2, (66, 66), drop=frozenset(["no_such_site"]))
  with pytest.raises(ValueError, match="exceed the 132 SMs"):
    peers.VirtualRanks(2, (100, 100)).launch_blocks(132)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from collective_matmul import kernels  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="stacked over 2 ranks"):
    kernels.all_gather_lhs_matmul_virtual(
        jnp.zeros((2, 128, 128)), jnp.zeros((3, 128, 128)),
        peers.VirtualRanks.even(2, 132), config=kernels.AllGatherConfig())
  with pytest.raises(TypeError, match="must be a peers.VirtualRanks"):
    kernels.matmul_reduce_scatter_virtual(
        jnp.zeros((2, 256, 128)), jnp.zeros((2, 128, 128)), None,
        config=kernels.ReduceScatterConfig())


@pytest.mark.parametrize("only", [["/default/", "/mutation/", "/skew/"],
                                  ["/picked/d8/", "/off_tiles/d2/"],
                                  ["/rowwise/"]])
def test_the_cases_trace_and_lower_without_a_gpu(only):
  selected = [c for c in rings.cases()
              if any(s in c.name for s in only)]
  assert selected
  assert rings.plan(selected, lower=_VERSION >= (0, 12)) == []


def _fake_worker(body):
  """A worker command that answers one case as `body` (Python) says."""
  return [sys.executable, "-c",
          "import sys, time, json\nfor line in sys.stdin:\n" + body]


def test_the_runner_reports_a_hang_and_a_dead_worker():
  ok = rings.Runner(hang_s=1, worker_cmd=_fake_worker(
      "  print('@@ running', flush=True)\n"
      "  print('@@ ' + json.dumps(dict(name=line.strip(), status='ok')),"
      " flush=True)\n"))
  assert ok.run("a")["status"] == "ok"
  assert ok.run("b")["status"] == "ok"  # The same worker, a second case.
  ok.close()
  hung = rings.Runner(hang_s=1, worker_cmd=_fake_worker(
      "  print('@@ running', flush=True)\n  time.sleep(600)\n"))
  result = hung.run("a")
  assert result["status"] == "hang"
  assert "1 s into running" in result["detail"]
  assert hung.proc is None  # Killed; the next case starts a new worker.
  dead = rings.Runner(hang_s=1, worker_cmd=_fake_worker("  sys.exit(3)\n"))
  assert dead.run("a")["status"] == "died"


def test_the_de65204_race_changes_the_traced_pipeline():
  """The mutation that puts commit de65204's race back leaves one more
  step's wgmmas in flight where a slot is freed."""
  case = next(c for c in rings.cases(quick=True) if c.early_free)
  fn, specs, _ = rings._program(case)  # pylint: disable=protected-access
  with rings._early_free():  # pylint: disable=protected-access
    racy = str(fn.trace(*specs).jaxpr)
  fn, specs, _ = rings._program(case)  # pylint: disable=protected-access
  assert str(fn.trace(*specs).jaxpr) != racy


def test_a_mutation_passes_only_when_caught():
  mutation = next(c for c in rings.cases(quick=True) if c.expect_fail)
  normal = next(c for c in rings.cases(quick=True) if not c.expect_fail)
  assert rings.verdict(mutation, dict(status="hang"))
  assert rings.verdict(mutation, dict(status="wrong"))
  assert not rings.verdict(mutation, dict(status="ok"))
  assert not rings.verdict(mutation, dict(status="error"))
  assert rings.verdict(normal, dict(status="ok"))
  assert not rings.verdict(normal, dict(status="hang"))


def test_the_kernels_reach_peers_only_through_the_seam():
  """Every remote ref, semaphore and device index of the ring kernels
  goes through `peers` (so virtual ranks run the product's schedule)."""
  pattern = re.compile(r"remote_ref|semaphore_signal|semaphore_wait|"
                       r"get_global|axis_index\(axis_name")
  for path in KERNELS.glob("*.py"):
    if path.name == "peers.py":
      continue
    code = path.read_text()
    if path.name == "all_gather_matmul_kernel.py":
      # Outside the kernel: `return_gathered` rotates the received shards.
      code = code.replace("jnp.roll(held, lax.axis_index(axis_name)", "")
    assert not pattern.search(code), (path.name, pattern.search(code))


def test_the_check_matches_numpy_and_catches_unwritten_ranks():
  """`check` (on the device) gives each rank's relative error as numpy
  does, inf for a rank with a NaN left by the poison, and a bit sum that
  moves with any one changed element."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  ref = rng.standard_normal((3, 96, 80)).astype(np.float32)
  out = jnp.asarray(ref + 1e-2 * rng.standard_normal(ref.shape), jnp.bfloat16)
  rel, total = rings.check(out, jnp.asarray(ref))
  x = np.asarray(out, np.float32)
  expected = [np.linalg.norm(x[r] - ref[r]) / np.linalg.norm(ref[r])
              for r in range(3)]
  np.testing.assert_allclose(np.asarray(rel), expected, rtol=1e-4)
  bits = np.asarray(out).view(np.uint16).astype(np.uint64).sum() % 2**32
  assert int(total) == int(bits)
  poisoned = out.at[1, 5, 7].set(jnp.nan)
  rel, moved = rings.check(poisoned, jnp.asarray(ref))
  rel = np.asarray(rel)
  assert np.isinf(rel[1]) and np.isfinite(rel[[0, 2]]).all()
  assert int(moved) != int(total)
  nudged = out.at[2, 0, 0].set(out[2, 0, 0] + 1)
  assert int(rings.check(nudged, jnp.asarray(ref))[1]) != int(total)


@pytest.mark.parametrize("name", [
    "reduce_scatter/off_tiles/d2/bf16/1000x1936x1064",
    "all_gather/rowwise/off_tiles/d2/fp8/1000x1936x1064"])
@pytest.mark.parametrize("unwritten", [False, True])
def test_a_case_runs_end_to_end_on_the_cpu(monkeypatch, unwritten, name):
  """`run_case`'s steps around the kernel (compile, operands, poison, two
  runs, the check on the device) with the kernel swapped for its f32
  reference cast to the output dtype: ok; with one rank left NaN, wrong."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  case = next(c for c in rings.cases() if c.name == name)
  real = rings._program  # pylint: disable=protected-access

  def program(case):
    _, specs, reference = real(case)

    def fake(*args):
      out = reference(*args).astype(jnp.bfloat16)
      return out.at[1].set(jnp.nan) if unwritten else out
    return jax.jit(fake), specs, reference
  monkeypatch.setattr(rings, "_program", program)
  result = rings.run_case(case)
  assert result["status"] == ("wrong" if unwritten else "ok"), result
  assert len(result["rank_errors"]) == case.d and not result["moved"]
  if unwritten:
    assert result["rank_errors"][1] == float("inf")
  else:
    assert result["rel_error"] < 1e-2


def test_skip_passed_leaves_out_only_what_passed_with_the_same_config(
    tmp_path, capsys):
  cases = rings.cases()
  ok, failed, other_config = cases[0], cases[1], cases[2]
  results = [dict(name=ok.name, config=repr(ok.config), passed=True),
             dict(name=failed.name, config=repr(failed.config), passed=False),
             dict(name=other_config.name, config="AllGatherConfig()",
                  passed=True)]
  path = tmp_path / "earlier.json"
  path.write_text(json.dumps(dict(results=results)))
  assert rings.passed_before([path]) == {(ok.name, repr(ok.config)),
                                         (other_config.name,
                                          "AllGatherConfig()")}
  assert rings.main(["--list", "--skip-passed", str(path)]) == 0
  listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
  assert listed == [c.name for c in cases[1:]]


def test_skip_passed_refuses_a_file_that_is_no_earlier_output(tmp_path, capsys):
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps(dict(rows=[])))
  for path in (bad, tmp_path / "missing.json"):
    with pytest.raises(SystemExit) as exit_info:
      rings.main(["--list", "--skip-passed", str(path)])
    assert exit_info.value.code == 2
    assert "not an earlier --out file" in capsys.readouterr().err


def test_the_gemm_shapes_are_the_cores_ten():
  """The rings' picked cases run at the shapes the core is timed at; the
  tool keeps its own copy so that its worker does not import the bench."""
  import bench_gemm_core  # pylint: disable=g-import-not-at-top
  assert rings.GEMM_SHAPES == bench_gemm_core.TEN_SHAPES
  assert len(set(rings.GEMM_SHAPES)) == 10
