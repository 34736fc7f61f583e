"""absl flags for the plugin, defined once when the package is imported.

Once absl has parsed the command line, the active configuration follows these
flags with no further call (`config.get_config`); `set_config` and
`config_context` in code still win.
"""
from __future__ import annotations

import dataclasses

from absl import flags

from collective_matmul import config as config_lib


def _define(field: dataclasses.Field):
  """The absl flag of one configuration field, from its declaration."""
  name, help_text = field.metadata["flag"], field.metadata["help"]
  choices = config_lib.option_choices(field)
  if choices:
    return flags.DEFINE_enum(name, str(field.default), list(choices),
                             help_text)
  if field.type == "bool":
    return flags.DEFINE_bool(name, field.default, help_text)
  return flags.DEFINE_list(name, list(field.default), help_text)


_FLAGS = {field.name: _define(field)
          for field in dataclasses.fields(config_lib.CollectiveMatmulConfig)}


def config_from_flags() -> config_lib.CollectiveMatmulConfig:
  """The configuration the parsed absl flags ask for.

  Raises:
    RuntimeError: when absl flags have not been parsed yet.
  """
  if not flags.FLAGS.is_parsed():
    raise RuntimeError(
        "absl flags are not parsed yet: call config_from_flags() after "
        "app.run() / FLAGS(argv), or build CollectiveMatmulConfig directly.")
  return config_lib.CollectiveMatmulConfig(
      **{name: flag.value for name, flag in _FLAGS.items()})


def _config_if_parsed() -> config_lib.CollectiveMatmulConfig | None:
  return config_from_flags() if flags.FLAGS.is_parsed() else None


config_lib.set_flag_reader(_config_if_parsed)
