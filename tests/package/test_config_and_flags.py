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


def test_parsed_flags_alone_switch_the_plugin(unparsed_flags):
  assert not cm.get_config().enabled
  unparsed_flags(["prog", "--use_collective_matmul",
                  "--collective_matmul_impl=ring"])
  active = cm.get_config()
  assert (active.enabled, active.impl) == (True, "ring")


def test_code_config_wins_over_parsed_flags(unparsed_flags):
  unparsed_flags(["prog", "--use_collective_matmul",
                  "--collective_matmul_impl=ring"])
  cm.set_config(cm.CollectiveMatmulConfig(enabled=False))
  assert not cm.get_config().enabled
  with cm.config_context(enabled=True, impl="baseline"):
    assert cm.get_config().impl == "baseline"
  cm.set_config(None)
  assert cm.get_config().impl == "ring"


_FLAGS_ONLY_PROGRAM = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
import numpy as np
from absl import flags
import collective_matmul as cm
flags.FLAGS(sys.argv)  # parses the plugin's flags; no set_config anywhere
mesh = jax.make_mesh((2, 4), ("data", "tensor"),
                     axis_types=(jax.sharding.AxisType.Explicit,) * 2)
with jax.set_mesh(mesh):
  x = jax.device_put(np.ones((8, 16), np.float32),
                     jax.sharding.PartitionSpec("tensor", None))
  w = jax.device_put(np.ones((16, 8), np.float32),
                     jax.sharding.PartitionSpec(None, "tensor"))
  out = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None,
                                                                    "tensor"))
  y = jax.jit(lambda a, b: cm.dot_general(a, b, (((1,), (0,)), ((), ())),
                                          out_sharding=out))(x, w)
  assert np.allclose(np.asarray(y), 16.0)
print("rewritten", sum(d.rewritten for d in cm.decisions()),
      [d.impl for d in cm.decisions()])
"""


@pytest.mark.parametrize("argv,expected", [
    (["--use_collective_matmul", "--collective_matmul_impl=ring"],
     "rewritten 1 ['ring']"),
    ([], "rewritten 0 []"),
])
def test_a_program_that_only_parses_flags(tmp_path, argv, expected):
  import subprocess
  import sys
  script = tmp_path / "flags_only.py"
  script.write_text(_FLAGS_ONLY_PROGRAM)
  env = {k: v for k, v in __import__("os").environ.items()
         if k != "XLA_FLAGS"}
  result = subprocess.run([sys.executable, str(script)] + argv,
                          capture_output=True, text=True, env=env,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert expected in result.stdout


def test_importing_the_package_does_not_import_pallas():
  import subprocess
  import sys
  program = ("import sys, collective_matmul\n"
             "loaded = lambda: [m for m in sys.modules if 'pallas' in m]\n"
             "assert not loaded(), loaded()\n"
             "from collective_matmul import kernels\n"
             "assert not loaded(), loaded()\n"
             "kernels.all_gather_lhs_matmul\n"
             "assert loaded()\n"
             "assert callable(kernels.matmul_reduce_scatter)\n")
  result = subprocess.run([sys.executable, "-c", program],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]


def _readme_options_table():
  import pathlib
  readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
  begin, end = "<!-- options:begin -->\n", "<!-- options:end -->"
  assert begin in readme and end in readme, "README lost its options table"
  return readme.split(begin, 1)[1].split(end, 1)[0].strip()


def test_readme_options_table_is_the_declared_one():
  from collective_matmul import config as config_lib
  assert _readme_options_table() == config_lib.options_table().strip(), (
      "README's options table drifted from CollectiveMatmulConfig: paste "
      "collective_matmul.config.options_table() between its markers")


def test_every_option_has_a_flag_whose_help_is_its_declaration():
  import dataclasses
  from absl import flags
  from collective_matmul import config as config_lib
  for field in dataclasses.fields(config_lib.CollectiveMatmulConfig):
    flag = flags.FLAGS[field.metadata["flag"]]
    # absl prefixes an enum's help with its choices.
    assert flag.help.endswith(field.metadata["help"]), field.name
    assert flag.default == (list(field.default)
                            if isinstance(field.default, tuple)
                            else field.default), field.name


def test_auto_is_described_as_it_decides():
  """auto goes to XLA's collective + GEMM, not the ring, on Hopper when the
  kernel may not run or does not pay: the help says so."""
  import dataclasses
  help_text = next(f.metadata["help"] for f in dataclasses.fields(
      cm.CollectiveMatmulConfig) if f.name == "impl")
  assert "NCCL + cuBLAS" in help_text and "too small" in help_text
  assert "command buffers" in help_text and "across processes" in help_text


@pytest.mark.parametrize("field,value", [
    ("enabled", "false"), ("enabled", 1), ("strict", None),
    ("save_gathered", "yes"), ("group_siblings", 0)])
def test_a_boolean_option_takes_only_a_boolean(field, value):
  with pytest.raises(TypeError, match=f"{field}=.* must be True or False"):
    cm.CollectiveMatmulConfig(**{field: value})
