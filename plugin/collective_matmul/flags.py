"""absl flags for the plugin, defined once when the package is imported.

Once absl has parsed the command line, the active configuration follows these
flags with no further call (`config.get_config`); `set_config` and
`config_context` in code still win.
"""
from __future__ import annotations

from absl import flags

from collective_matmul import config as config_lib

_USE = flags.DEFINE_bool(
    "use_collective_matmul", False,
    "Rewrite all-gather-then-matmul patterns into a collective matmul.")
_IMPL = flags.DEFINE_enum(
    "collective_matmul_impl", "auto", list(config_lib.IMPLEMENTATIONS),
    "auto: the Hopper Pallas kernel where it applies, else the portable ring; "
    "pallas / ring / baseline force one implementation.")
_STRICT = flags.DEFINE_bool(
    "collective_matmul_strict", False,
    "Raise instead of falling back when a detected pattern cannot be served.")

_SAVE_GATHERED = flags.DEFINE_bool(
    "collective_matmul_save_gathered", True,
    "Keep the gathered activations from the forward for the weight gradient "
    "(D x their memory, as XLA's own autodiff of all-gather + dot keeps) "
    "instead of all-gathering them again in the backward.")
_RS_KERNEL = flags.DEFINE_bool(
    "collective_matmul_reduce_scatter_kernel", True,
    "Use the Hopper matmul-reduce-scatter kernel where it applies (auto, and "
    "the backward of the all-gather kernel); off: XLA's instead.")

_GROUP_SIBLINGS = flags.DEFINE_bool(
    "collective_matmul_group_siblings", True,
    "Run projections of one activation (unfused q/k/v, wi_0/wi_1) as one "
    "collective matmul over their concatenated weights; off: one each.")

_EXCLUDE = flags.DEFINE_list(
    "collective_matmul_exclude", [],
    "Comma-separated names (as in the decision record, e.g. "
    "decoder/logits_dense) or shell-style patterns (*logits*) of projections "
    "to leave to XLA.")


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
      enabled=_USE.value, impl=_IMPL.value, strict=_STRICT.value,
      save_gathered=_SAVE_GATHERED.value,
      reduce_scatter_kernel=_RS_KERNEL.value,
      group_siblings=_GROUP_SIBLINGS.value, exclude=tuple(_EXCLUDE.value))


def _config_if_parsed() -> config_lib.CollectiveMatmulConfig | None:
  return config_from_flags() if flags.FLAGS.is_parsed() else None


config_lib._from_parsed_flags = _config_if_parsed  # pylint: disable=protected-access
