"""collective_matmul inside real MaxText (no fork, no MaxText file edited).

    from collective_matmul.integrations import maxtext as cm_maxtext
    cm_maxtext.install()   # before MaxText traces its train step

or launch MaxText through the plugin:

    python -m collective_matmul.integrations.maxtext \\
        <maxtext>/configs/base.yml key=value ... --use_collective_matmul

Served (training graphs, bf16/f32, the logical/Auto route): MlpBlock's
wi_0 / wi_1 / fused wi (all-gather) and wo (matmul + reduce-scatter);
Attention's query, key, value, fused qkv (all-gather) and out (matmul +
reduce-scatter); the decoder's logits, dense or through the tied embedding
(all-gather); with `quantization=fp8` or Qwix's `fp8_gpu`, the same
projections in Flax's fp8 math on MaxText's fp8 state; with Qwix's
`fp8_full`, `fp8`, `fp8_e4m3` or `fp8_e5m2`, the same projections in
Qwix's own quantization, its rowwise scales in the collective matmuls
(`qwix_fp8`). Other quantization modes (Qwix's int8, int4, fp4,
fp8_nanoo; AQT), fp8 weights, unknown and
non-training projections, and a mixture-of-experts block's router gate and
routed experts, take MaxText's own path, each recorded with its reason in
`collective_matmul.decisions()`.

Separately, `--maxtext_shard_gpu_attention` (off by default; `attention.py`)
runs MaxText's GPU flash attention per shard of batch and heads, where
MaxText 0.2.5 has every device compute every head.
"""
from collective_matmul.integrations.maxtext.adapter import MaxTextVersionError
from collective_matmul.integrations.maxtext.adapter import SUPPORTED_MAXTEXT_VERSIONS
from collective_matmul.integrations.maxtext.adapter import check_maxtext
from collective_matmul.integrations.maxtext.adapter import install
from collective_matmul.integrations.maxtext.adapter import is_installed
from collective_matmul.integrations.maxtext.adapter import uninstall
from collective_matmul.integrations.maxtext.projections import PROJECTIONS
