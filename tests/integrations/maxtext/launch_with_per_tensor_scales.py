"""The plugin's MaxText launcher with a planted bug: the rowwise fp8
products get one scale per tensor (each scale's largest entry, on every row
or column) in place of Qwix's per-row and per-column scales. The positive
control of test_qwix_training.py's loss comparison.

    python launch_with_per_tensor_scales.py <MaxText and plugin arguments>
"""
import runpy
import sys

import jax.numpy as jnp

from collective_matmul import qwix_fp8

_free_scale = qwix_fp8._free_scale  # pylint: disable=protected-access


def _per_tensor(q, contract):
  scale = _free_scale(q, contract)
  return jnp.broadcast_to(jnp.max(scale), scale.shape)


qwix_fp8._free_scale = _per_tensor  # pylint: disable=protected-access
sys.argv = ["collective_matmul.integrations.maxtext", *sys.argv[1:]]
runpy.run_module("collective_matmul.integrations.maxtext",
                 run_name="__main__", alter_sys=True)
