"""CollectiveMatmulConfig, config_context and the absl flags."""
from absl import flags
import pytest

import collective_matmul as cm


def test_config_rejects_unknown_impl():
  with pytest.raises(ValueError, match="'bogus'"):
    cm.CollectiveMatmulConfig(impl="bogus")


@pytest.mark.parametrize("fallback", ["pallas", "auto", "nope"])
def test_config_rejects_fallback_impl_that_is_not_portable(fallback):
  with pytest.raises(ValueError, match=f"fallback_impl={fallback!r}"):
    cm.CollectiveMatmulConfig(fallback_impl=fallback)


@pytest.mark.parametrize("impl", ["auto", "pallas", "ring", "baseline"])
def test_config_accepts_every_impl(impl):
  assert cm.CollectiveMatmulConfig(impl=impl).impl == impl


def test_config_defaults_are_off():
  config = cm.CollectiveMatmulConfig()
  assert (config.enabled, config.impl, config.strict) == (False, "auto",
                                                          False)


def test_config_context_nesting_restores():
  before = cm.get_config()
  with cm.config_context(enabled=True, impl="ring") as outer:
    assert cm.get_config() is outer
    assert (outer.enabled, outer.impl, outer.strict) == (True, "ring", False)
    with cm.config_context(impl="baseline", strict=True) as inner:
      assert cm.get_config() is inner
      # Overrides apply on top of the active configuration.
      assert (inner.enabled, inner.impl, inner.strict) == (True, "baseline",
                                                           True)
    assert cm.get_config() is outer
  assert cm.get_config() is before


def test_config_context_restores_after_exception():
  before = cm.get_config()
  with pytest.raises(RuntimeError):
    with cm.config_context(enabled=True):
      raise RuntimeError("boom")
  assert cm.get_config() is before


def test_config_context_with_explicit_config_object():
  config = cm.CollectiveMatmulConfig(enabled=True, impl="baseline")
  with cm.config_context(config, strict=True) as active:
    assert (active.enabled, active.impl, active.strict) == (True, "baseline",
                                                            True)


def test_config_context_rejects_bad_override():
  before = cm.get_config()
  with pytest.raises(ValueError, match="'bogus'"):
    with cm.config_context(impl="bogus"):
      pass
  assert cm.get_config() is before


def test_set_config_changes_default_and_context_overrides_it():
  cm.set_config(cm.CollectiveMatmulConfig(enabled=True, impl="baseline"))
  assert cm.get_config().impl == "baseline"
  with cm.config_context(impl="ring"):
    assert cm.get_config().impl == "ring" and cm.get_config().enabled
  assert cm.get_config().impl == "baseline"


def test_set_config_rejects_non_config():
  with pytest.raises(TypeError, match="CollectiveMatmulConfig"):
    cm.set_config({"enabled": True})


@pytest.fixture
def unparsed_flags():
  flags.FLAGS.unparse_flags()
  yield flags.FLAGS
  flags.FLAGS.unparse_flags()


def test_flags_parse_into_config(unparsed_flags):
  unparsed_flags(["prog", "--use_collective_matmul",
                  "--collective_matmul_impl=ring",
                  "--collective_matmul_strict"])
  config = cm.config_from_flags()
  assert isinstance(config, cm.CollectiveMatmulConfig)
  assert (config.enabled, config.impl, config.strict) == (True, "ring", True)


def test_flags_defaults_give_disabled_config(unparsed_flags):
  unparsed_flags(["prog"])
  config = cm.config_from_flags()
  assert (config.enabled, config.impl, config.strict) == (False, "auto",
                                                          False)


def test_flags_reject_unknown_impl(unparsed_flags):
  with pytest.raises(flags.IllegalFlagValueError):
    unparsed_flags(["prog", "--collective_matmul_impl=bogus"])


def test_config_from_unparsed_flags_raises(unparsed_flags):
  assert not unparsed_flags.is_parsed()
  with pytest.raises(RuntimeError, match="not parsed"):
    cm.config_from_flags()
