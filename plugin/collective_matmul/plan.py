"""What runs for one collective matmul and its backward: `KernelPlan`.

`selection.choose` makes one; the drop-in records it, and `ops`,
`primitives` and `dispatch` carry it down and run it as it says (the
implementation, its config, and how the kernel is handed its operands),
deciding nothing again. Below `selection` (which fills it) and above the
kernels' configs and the ring (whose configs it holds).
"""
from __future__ import annotations

import dataclasses
import math

from collective_matmul.enums import Collective
from collective_matmul.enums import Impl
from collective_matmul.enums import RowLayout
from collective_matmul.enums import WeightLayout
from collective_matmul.kernels.configs import TileConfig
from collective_matmul.kernels.schedule import supports_rows_per_batch
from collective_matmul.ring import RingConfig

# Each implementation's config type (baseline: none).
_CONFIGS = {Impl.PALLAS: TileConfig, Impl.RING: RingConfig,
            Impl.BASELINE: type(None)}


def kernel_rows(collective: Collective, shape, axis: int,
                axis_size: int) -> tuple[int, int | None]:
  """(rows, rows_per_batch) of `x` of `shape` ([..., k]) split on `axis`
  as a kernel sees them: its rows before the all-gather or after the
  reduce-scatter, and the run of them per leading index (None where `axis`
  is the first: one run)."""
  rows = math.prod(shape[:-1])
  run = math.prod(shape[axis:-1])
  if collective == Collective.REDUCE_SCATTER:
    rows, run = rows // axis_size, run // axis_size
  return rows, None if axis == 0 else run


def _row_layout(impl: Impl, config, rows: int,
                rows_per_batch: int | None) -> RowLayout | None:
  """The kernel addresses each run of rows where its tiles fit the run,
  else the split dimension is moved first; the portable impls need none."""
  if impl != Impl.PALLAS:
    return None
  if rows_per_batch is None or supports_rows_per_batch(config, rows,
                                                      rows_per_batch):
    return RowLayout.AS_GIVEN
  return RowLayout.AXIS_FIRST


@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """What runs for one collective matmul and its backward (hashable: the
  ops carry it as a static argument).

  impl, config, source: the forward's implementation and its config (for
  `pallas` a `TileConfig` and where it came from: "caller", "autotune
  cache", "packaged table" or "heuristic"; for `ring` a `RingConfig`, the
  default one when None is given; for `baseline` none). backward_impl,
  backward_config, backward_source: the same for the backward's collective
  matmul (dx: the other collective). reason: why not the Hopper kernel (""
  when it runs, or was not asked for). is_fallback: an explicit `pallas`
  could not be served. dtypes, backward_dtypes: for fp8 operands, the
  forward's and the backward's operand and result dtypes as the record
  names them (`e4m3 x e4m3 -> bf16`; `Problem.dtype_label`), else "".
  row_layout, weight_layout (and the backward's): how the kernel is handed
  its operand's rows and its weight (`pallas` only, default as given and
  `[k, n]`; None for the portable impls, which take them as given).
  """

  impl: Impl
  backward_impl: Impl
  config: TileConfig | RingConfig | None = None
  source: str = ""
  backward_config: TileConfig | RingConfig | None = None
  backward_source: str = ""
  reason: str = ""
  is_fallback: bool = False
  dtypes: str = ""
  backward_dtypes: str = ""
  row_layout: RowLayout | None = None
  weight_layout: WeightLayout | None = None
  backward_row_layout: RowLayout | None = None
  backward_weight_layout: WeightLayout | None = None

  def __post_init__(self):
    for prefix in ("", "backward_"):
      impl_field, config_field = f"{prefix}impl", f"{prefix}config"
      impl = Impl.parse(getattr(self, impl_field), impl_field, _CONFIGS)
      config = getattr(self, config_field)
      if impl == Impl.RING and config is None:
        config = RingConfig()
      expected = _CONFIGS[impl]
      if not isinstance(config, expected):
        what = ("no config" if expected is type(None)
                else f"a {expected.__name__}")
        raise ValueError(f"a {impl} plan runs {what}: {impl_field}={impl} "
                         f"with {config_field}={config!r}")
      object.__setattr__(self, impl_field, impl)
      object.__setattr__(self, config_field, config)
      for field, vocabulary, default in (
          ("row_layout", RowLayout, RowLayout.AS_GIVEN),
          ("weight_layout", WeightLayout, WeightLayout.KN)):
        name = prefix + field
        value = getattr(self, name)
        object.__setattr__(
            self, name, None if impl != Impl.PALLAS else default
            if value is None else vocabulary.parse(value, name))

  def transposed(self) -> KernelPlan:
    """The plan of the backward's collective matmul: this plan's backward
    forward, and this plan's forward as its backward."""
    return dataclasses.replace(
        self, impl=self.backward_impl, config=self.backward_config,
        source=self.backward_source, backward_impl=self.impl,
        backward_config=self.config, backward_source=self.source,
        dtypes=self.backward_dtypes, backward_dtypes=self.dtypes,
        row_layout=self.backward_row_layout,
        weight_layout=self.backward_weight_layout,
        backward_row_layout=self.row_layout,
        backward_weight_layout=self.weight_layout)

  def for_rows(self, rows: int, rows_per_batch: int | None) -> KernelPlan:
    """This plan with the row layouts for `rows` in runs of
    `rows_per_batch` (`kernel_rows`; a collective matmul and its backward
    see the same), each by its own config: what `choose` fixes, and what a
    batched call (`vmap`, a new leading dimension) fixes again."""
    return dataclasses.replace(
        self,
        row_layout=_row_layout(self.impl, self.config, rows, rows_per_batch),
        backward_row_layout=_row_layout(self.backward_impl,
                                        self.backward_config, rows,
                                        rows_per_batch))

  def describe(self, backward: bool = False, dtypes: bool = True) -> str:
    """'pallas 128x256x64 s4 (packaged table)', 'ring', 'ring one-way' or
    'baseline': the implementation with what its config changes, and
    (with `dtypes`) for fp8 the dtypes it runs ('pallas e4m3 x e4m3 -> bf16
    128x256x128 s4 (heuristic)')."""
    impl, config, source, labels = (
        (self.backward_impl, self.backward_config, self.backward_source,
         self.backward_dtypes) if backward
        else (self.impl, self.config, self.source, self.dtypes))
    what = f"{impl} {labels}" if labels and dtypes else str(impl)
    if isinstance(config, TileConfig):
      return f"{what} {config_label(config)} ({source})"
    if isinstance(config, RingConfig) and not config.bidirectional:
      return f"{what} one-way"
    return what


def config_label(config: TileConfig) -> str:
  """A config in a few characters: the CTA tile m x n x k, the pipeline
  stages, then every other field that differs from its default
  (`128x256x64 s4 sender_sms=4 k_major_sends`)."""
  shown = ("tile_m", "tile_n", "tile_k", "max_concurrent_steps")
  defaults = type(config)()
  extras = []
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if field.name in shown or value == getattr(defaults, field.name):
      continue
    if isinstance(value, bool):
      extras.append(field.name if value else f"no_{field.name}")
    else:
      extras.append(f"{field.name}={value}")
  return " ".join([f"{config.cta_tile_m}x{config.cta_tile_n}x"
                   f"{config.tile_k} s{config.max_concurrent_steps}"]
                  + extras)
