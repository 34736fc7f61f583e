"""The plugin's closed vocabularies.

String enums: a member equals its value (`Impl.RING == "ring"`), prints
(str and repr) as it, and serialises to JSON as it, so flag values, config
fields and cache keys written as strings keep working. Strings are turned
into members once, where they enter (the config, the ops, the selection
layer's public functions), by `parse`, the one place that validates them.
"""
from __future__ import annotations

import enum
from typing import Iterable


class _Vocabulary(enum.StrEnum):

  def __repr__(self):
    # As the string it replaces: reprs of configs, decisions and lists of
    # them read as they did with strings.
    return repr(self.value)

  @classmethod
  def parse(cls, value, name: str, allowed: Iterable | None = None):
    """`value` (a member or its string) as a member of `allowed` (default:
    all); a ValueError naming `name` and the choices otherwise."""
    choices = tuple(cls) if allowed is None else tuple(map(cls, allowed))
    try:
      member = cls(value)
    except ValueError:
      member = None
    if member not in choices:
      raise ValueError(f"{name}={value!r} is not one of "
                       f"{tuple(c.value for c in choices)}")
    return member


class Impl(_Vocabulary):
  """Which implementation serves a collective matmul."""

  AUTO = "auto"  # The Hopper kernel where it applies and pays off.
  PALLAS = "pallas"  # The Hopper (Pallas Mosaic GPU) kernel.
  RING = "ring"  # The portable ppermute ring.
  BASELINE = "baseline"  # XLA's collective, then one dot.


class Collective(_Vocabulary):
  """Which collective a collective matmul overlaps with the matmul."""

  ALL_GATHER = "all_gather"  # all_gather(x) @ w
  REDUCE_SCATTER = "reduce_scatter"  # reduce_scatter(x @ w)

  @property
  def transpose(self) -> Collective:
    """The other collective: the one this one's backward (dx) runs."""
    return (Collective.REDUCE_SCATTER if self is Collective.ALL_GATHER
            else Collective.ALL_GATHER)


class MatmulDimension(_Vocabulary):
  """A dimension of a matmul's output (as JAX's
  `hopper_matmul_mgpu.MatmulDimension`): the kernel configs' split of a
  tile between warpgroups (`TileConfig.wg_dimension`)."""

  M = "m"  # Rows.
  N = "n"  # Columns.


class WeightLayout(_Vocabulary):
  """How a kernel is handed its weight."""

  KN = "kn"  # [k, n], as the matmul names it.
  NK = "nk"  # [n, k], K-major (8-bit wgmma operands are read so).


class RowLayout(_Vocabulary):
  """How a kernel sees the rows of an operand split on a dimension other
  than the first (`[b, s, k]` split on `s`)."""

  AS_GIVEN = "as_given"  # A free reshape; each run of rows addressed.
  AXIS_FIRST = "axis_first"  # The split dimension moved first (a copy).
