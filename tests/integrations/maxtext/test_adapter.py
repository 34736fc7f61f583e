"""The MaxText adapter's guard, install and uninstall, in process."""
import inspect
import os
import subprocess
import sys

import pytest

from collective_matmul.integrations import maxtext as cm_maxtext
from collective_matmul.integrations.maxtext import adapter


@pytest.fixture
def linears():
  from maxtext.layers import linears as module  # pylint: disable=g-import-not-at-top
  yield module
  cm_maxtext.uninstall()


def test_the_installed_maxtext_is_supported():
  assert cm_maxtext.check_maxtext() in cm_maxtext.SUPPORTED_MAXTEXT_VERSIONS


def test_an_unsupported_version_is_refused(monkeypatch):
  monkeypatch.setattr(adapter.importlib.metadata, "version",
                      lambda name: "9.9.9")
  with pytest.raises(cm_maxtext.MaxTextVersionError, match="9.9.9"):
    cm_maxtext.install()
  assert not cm_maxtext.is_installed()


def test_a_changed_private_signature_is_refused(linears, monkeypatch):
  monkeypatch.setattr(linears, "_compute_dot_general_nnx",
                      lambda inputs, kernel, new_argument: None)
  with pytest.raises(cm_maxtext.MaxTextVersionError,
                     match="_compute_dot_general_nnx.*new_argument"):
    cm_maxtext.install()
  assert not cm_maxtext.is_installed()


def test_install_is_idempotent_and_uninstall_restores(linears):
  from maxtext.layers import attention_op  # pylint: disable=g-import-not-at-top
  from maxtext.layers import attentions  # pylint: disable=g-import-not-at-top

  def current():
    return (linears._compute_dot_general_nnx,
            linears.DenseGeneral.__call__, linears.MlpBlock.__call__,
            attentions.Attention.__call__,
            attention_op.AttentionOp.apply_attention)

  originals = current()
  triton = attention_op.tokamax_pallas_triton
  cm_maxtext.install()
  cm_maxtext.install()
  patched = current()
  assert all(p is not o for p, o in zip(patched, originals))
  assert all(inspect.unwrap(p) is o for p, o in zip(patched, originals))
  assert attention_op.tokamax_pallas_triton is not triton
  assert (attention_op.tokamax_pallas_triton.PallasTritonFlashAttention
          is not triton.PallasTritonFlashAttention)
  cm_maxtext.uninstall()
  assert current() == originals
  assert attention_op.tokamax_pallas_triton is triton


def test_every_patched_name_is_one_the_install_checks(linears):
  """The names install() patches are exactly the rows of the one table
  (`adapter.PATCHES`) that are patched, each with its parameters checked:
  a patch added without its check fails here."""
  del linears  # Uninstalls after.
  cm_maxtext.install()
  patched = adapter.patched_names()
  assert len(patched) == len(set(patched))
  assert sorted(patched) == sorted(
      row.name for row in adapter.PATCHES if row.make is not None)
  for row in adapter.PATCHES:
    if row.make is not None and row.name != (
        "attention_op.tokamax_pallas_triton.PallasTritonFlashAttention"):
      assert row.parameters, f"{row.name} is patched without a check"
    owner, attr = row.owner()
    if callable(row.make):
      assert inspect.unwrap(getattr(owner, attr)) is not getattr(owner, attr)


def test_no_patch_reads_an_argument_by_position():
  """The patches read MaxText's arguments by parameter name."""
  import re  # pylint: disable=g-import-not-at-top
  from collective_matmul.integrations.maxtext import dense  # pylint: disable=g-import-not-at-top
  from collective_matmul.integrations.maxtext import owners  # pylint: disable=g-import-not-at-top
  for module in (adapter, dense, owners):
    source = inspect.getsource(module)
    assert not re.search(r"\bargs\[\d", source), module.__name__


def _fake_version(monkeypatch, version="0.3.0.dev0"):
  monkeypatch.setattr(adapter.importlib.metadata, "version",
                      lambda name: version)
  return version


def _warnings(monkeypatch):
  said = []
  monkeypatch.setattr(adapter.logging, "warning",
                      lambda message, *args: said.append(message % args))
  return said


def test_an_untested_version_refused_by_default_says_how_to_allow_it(
    monkeypatch):
  _fake_version(monkeypatch)
  monkeypatch.delenv(adapter.ALLOW_UNTESTED_ENV, raising=False)
  with pytest.raises(cm_maxtext.MaxTextVersionError,
                     match="--maxtext_allow_untested_version"):
    cm_maxtext.install()
  assert not cm_maxtext.is_installed()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_an_untested_version_with_matching_signatures_installs_when_allowed(
    linears, monkeypatch, how):
  version = _fake_version(monkeypatch)
  said = _warnings(monkeypatch)
  if how == "environment":
    monkeypatch.setenv(adapter.ALLOW_UNTESTED_ENV, "1")
    assert cm_maxtext.install() == version
  else:
    monkeypatch.delenv(adapter.ALLOW_UNTESTED_ENV, raising=False)
    assert cm_maxtext.install(allow_untested_version=True) == version
  assert cm_maxtext.is_installed()
  assert len(said) == 1, said
  assert version in said[0] and "tested: 0.2.5" in said[0]


def test_an_allowed_untested_version_with_a_changed_signature_is_refused(
    linears, monkeypatch):
  _fake_version(monkeypatch)
  said = _warnings(monkeypatch)
  monkeypatch.setattr(linears, "_compute_dot_general_nnx",
                      lambda inputs, kernel, new_argument: None)
  with pytest.raises(cm_maxtext.MaxTextVersionError,
                     match="_compute_dot_general_nnx.*new_argument"):
    cm_maxtext.install(allow_untested_version=True)
  assert not cm_maxtext.is_installed() and not said


def test_the_launchers_help_exits_0_and_lists_the_launchers_flags():
  run = subprocess.run(
      [sys.executable, "-m", "collective_matmul.integrations.maxtext",
       "--help"], capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert run.returncode == 0, run.stderr[-3000:]
  assert "--maxtext_allow_untested_version" in run.stdout
  assert "--use_collective_matmul" in run.stdout


def test_a_strict_refusal_in_the_launcher_is_one_line():
  # Was a 49-line traceback (issue 30, item 6). On CPU pallas cannot run,
  # and --collective_matmul_strict refuses the fallback.
  import maxtext_runs  # pylint: disable=g-import-not-at-top
  with pytest.raises(AssertionError) as failed:
    maxtext_runs.train("strict-pallas-on-cpu", steps=1, plugin=(
        "--use_collective_matmul", "--collective_matmul_impl=pallas",
        "--collective_matmul_strict"))
  message = str(failed.value)
  assert "failed (1)" in message
  stderr = message.split("\n", 2)[2]
  assert "Traceback" not in stderr, stderr
  (line,) = [l for l in stderr.splitlines() if "(strict)" in l]
  assert line.startswith("python -m collective_matmul.integrations.maxtext: "
                         "collective matmul (strict): ")
  assert "pallas unavailable" in line
