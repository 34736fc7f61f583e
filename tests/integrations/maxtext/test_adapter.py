"""The MaxText adapter's guard, install and uninstall, in process."""
import inspect

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
