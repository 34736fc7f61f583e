"""The plugin's MaxText launcher with tokamax's XLA attention standing in for
its Triton kernel (which cannot run on CPU), so MaxText's GPU flash attention
call (`attention=flash`) and `--maxtext_shard_gpu_attention` run on CPU.

    python launch_with_xla_attention.py <MaxText and plugin arguments>
"""
import runpy
import sys

from tokamax._src.ops.attention import jax_nn

from collective_matmul.integrations.maxtext import attention

attention.install(
    lambda *a, **k: jax_nn.JaxNnDotProductAttention(implementation="xla"))
sys.argv = ["collective_matmul.integrations.maxtext", *sys.argv[1:]]
runpy.run_module("collective_matmul.integrations.maxtext",
                 run_name="__main__", alter_sys=True)
