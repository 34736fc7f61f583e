"""The sharding information of one `dot_general`, read two ways: from the
operands' types on an Explicit mesh, or from logical axis names through the
active Flax rules (Auto-sharded models); and the result's layout the caller
asked for. Specs come back normalized (`patterns.normalize_spec`).
"""
from __future__ import annotations

import jax

from collective_matmul import patterns


def mesh_of(lhs, rhs, mode):
  """The mesh the operands live on, or None.

  Explicit mode: the operands' types say. Logical mode: the mesh set with
  `jax.set_mesh`, else the one of a legacy `with mesh:` block (Paxml and
  older MaxText enter their mesh that way).
  """
  if mode == "explicit":
    return jax.typeof(lhs).sharding.mesh
  mesh = jax.sharding.get_abstract_mesh()
  return _legacy_context_mesh() if mesh.empty else mesh


def _legacy_context_mesh():
  """The concrete `Mesh` of the innermost `with mesh:` block, or None.

  JAX 0.10 has no public accessor for it; `shard_map(mesh=...)` takes the
  concrete mesh as it is.
  """
  try:
    from jax._src import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    mesh = mesh_lib.thread_resources.env.physical_mesh
  except (ImportError, AttributeError):  # A JAX without the legacy context.
    return None
  return None if mesh.empty else mesh


def explicit_specs(lhs, rhs):
  """The operands' specs (normalized) from their types, or None where they
  carry no sharding on one common Explicit mesh."""
  lhs_sharding = getattr(jax.typeof(lhs), "sharding", None)
  rhs_sharding = getattr(jax.typeof(rhs), "sharding", None)
  if lhs_sharding is None or rhs_sharding is None:
    return None
  mesh = lhs_sharding.mesh
  if mesh.empty or rhs_sharding.mesh != mesh:
    return None
  explicit = jax.sharding.AxisType.Explicit
  if not any(t == explicit for t in mesh.axis_types):
    return None
  return (patterns.normalize_spec(lhs_sharding.spec, lhs.ndim),
          patterns.normalize_spec(rhs_sharding.spec, rhs.ndim))


def logical_specs(lhs, rhs, lhs_axes, rhs_axes):
  """The operands' specs (normalized) from their logical axis names under
  the active Flax rules; a ValueError where the names do not fit."""
  import flax.linen as nn  # Only logical-axis users need Flax.
  for axes, array, name in ((lhs_axes, lhs, "lhs"), (rhs_axes, rhs, "rhs")):
    if len(axes) != array.ndim:
      raise ValueError(f"{name} logical axes {axes} do not match its "
                       f"{array.ndim} dimensions {array.shape}")
  return (patterns.normalize_spec(nn.logical_to_mesh_axes(lhs_axes), lhs.ndim),
          patterns.normalize_spec(nn.logical_to_mesh_axes(rhs_axes), rhs.ndim))


def out_spec(out_sharding, out_axes, out_ndim):
  """The result layout the caller asked for, normalized, or None.

  Raises:
    ValueError: when it cannot be read (names the offending value).
  """
  if out_sharding is not None:
    spec = getattr(out_sharding, "spec", out_sharding)
    if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
      raise ValueError(f"{spec} asks for an unreduced/reduced result")
    return patterns.normalize_spec(spec, out_ndim)
  if out_axes is not None:
    import flax.linen as nn  # Only logical-axis users need Flax.
    if len(out_axes) != out_ndim:
      raise ValueError(f"out_axes {out_axes} do not match the result's "
                       f"{out_ndim} dimensions")
    return patterns.normalize_spec(nn.logical_to_mesh_axes(out_axes),
                                   out_ndim)
  return None
