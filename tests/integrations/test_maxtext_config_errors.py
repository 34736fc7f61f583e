"""MaxText's config errors as one line naming the key (issue 39, item 9):
`config_errors.describe`, a function of the exception alone, so it runs
without MaxText. The launcher end to end: tests/integrations/maxtext."""
import os
import sys

import pytest

from collective_matmul.integrations.maxtext import config_errors

_ARGV = ("launcher", "/configs/base.yml", "run_name=r", "steps=5",
         "ici_tensor_parallelism=3", "--use_collective_matmul")


def _unknown_key_error(key, valid):
  # pyconfig's text: the key, then every valid key.
  return ValueError(f"{key!r} not in {', '.join(map(repr, valid))}.")


def test_an_unknown_key_is_named_without_the_list_of_valid_keys(rng):
  valid = [f"key_{i}" for i in rng.permutation(300)]
  error = config_errors.describe(
      _unknown_key_error("no_such_key", valid), _ARGV)
  assert error.key == "no_such_key"
  assert str(error) == "no_such_key: not a MaxText config key"


def test_a_misspelt_key_gets_the_close_valid_keys():
  valid = ["base_emb_dim", "base_mlp_dim", "steps", "run_name"]
  error = config_errors.describe(
      _unknown_key_error("base_emb_dimm", valid), _ARGV)
  assert error.key == "base_emb_dimm"
  assert "did you mean base_emb_dim" in str(error)
  assert "run_name" not in str(error)


def test_a_missing_config_file_is_named_as_such(tmp_path):
  missing = str(tmp_path / "nope.yml")
  error = config_errors.describe(
      FileNotFoundError(2, "No such file or directory", missing),
      ("launcher", missing, "steps=1"))
  assert error.key == "config file"
  assert str(error) == (f"config file: cannot read {missing}: No such file "
                        "or directory")


def test_a_missing_base_config_it_names_is_the_base_config_key(tmp_path):
  error = config_errors.describe(
      FileNotFoundError(2, "No such file or directory",
                        str(tmp_path / "parent.yml")),
      ("launcher", str(tmp_path / "child.yml")))
  assert error.key == "base_config"


def test_any_other_error_is_its_last_meaningful_line_and_the_key_it_names():
  error = config_errors.describe(
      ValueError("Traceback-like preamble\n\n  steps must be positive, "
                 "got -3  \nFor further information visit https://x\n"),
      _ARGV)
  assert error.key == "steps"
  assert str(error) == "steps: steps must be positive, got -3"
  assert "\n" not in str(error)


def test_an_error_naming_no_given_key_has_none():
  error = config_errors.describe(RuntimeError("something broke"), _ARGV)
  assert (error.key, str(error)) == (None, "something broke")
  assert str(config_errors.describe(AssertionError(), _ARGV)) == (
      "AssertionError")


def test_a_mesh_error_names_the_parallelism_keys_given_and_the_devices():
  error = config_errors.describe_mesh(
      AssertionError("Unspecified value unable to be determined with the "
                     "given      ICI parallelism values"), _ARGV, 8)
  assert error.key == "ici_tensor_parallelism=3"
  assert str(error) == (
      "ici_tensor_parallelism=3: Unspecified value unable to be determined "
      "with the given ICI parallelism values (8 devices)")
  assert config_errors.describe_mesh(
      ValueError("bad"), ("launcher", os.devnull), 4).key == "the mesh"


def _exits_as_maxtext_does(error):
  """pyconfig outside tests: logs `error`, then exits 2 while handling it."""
  def initialize(argv):
    del argv
    try:
      raise error
    except Exception:  # pylint: disable=broad-exception-caught
      sys.exit(2)
  return initialize


def test_an_exit_while_handling_a_config_error_raises_it_in_one_line():
  error = _unknown_key_error("no_such_key", ["steps"])
  initialize = config_errors.checked(_exits_as_maxtext_does(error), _ARGV)
  with pytest.raises(config_errors.MaxTextConfigError) as raised:
    initialize(_ARGV)
  assert raised.value.key == "no_such_key"
  assert raised.value.__cause__ is error


def test_an_exit_of_its_own_and_a_valid_config_pass_through():
  def exits(argv):
    del argv
    sys.exit(3)
  with pytest.raises(SystemExit) as exited:
    config_errors.checked(exits, _ARGV)(_ARGV)
  assert exited.value.code == 3
  config = object()
  built = []
  assert config_errors.checked(lambda argv: config, _ARGV,
                               built.append)(_ARGV) is config
  assert built == [config]


def test_a_mesh_the_devices_cannot_make_is_raised_naming_its_keys():
  def build_mesh(config):
    del config
    raise AssertionError("Unspecified value unable to be determined")
  initialize = config_errors.checked(lambda argv: object(), _ARGV,
                                     build_mesh, lambda: 8)
  with pytest.raises(config_errors.MaxTextConfigError) as raised:
    initialize(_ARGV)
  assert raised.value.key == "ici_tensor_parallelism=3"
  assert str(raised.value).endswith("(8 devices)")


def test_a_plugin_flag_written_as_a_key_is_pointed_to_its_flag():
  flags = {"use_collective_matmul": True, "collective_matmul_impl": False}
  argv = ("launcher", "base.yml", "steps=5", "use_collective_matmul=True",
          "collective_matmul_impl=ring", "--collective_matmul_strict")
  line = config_errors.plugin_flags_written_as_keys(argv, flags)
  assert line == (
      "use_collective_matmul=True: not a MaxText config key but the plugin's "
      "flag: write --use_collective_matmul; collective_matmul_impl=ring: not "
      "a MaxText config key but the plugin's flag: write "
      "--collective_matmul_impl=ring")
  assert config_errors.plugin_flags_written_as_keys(
      ("launcher", "base.yml", "steps=5", "--use_collective_matmul"),
      flags) is None
