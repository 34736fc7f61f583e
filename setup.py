"""collective_matmul: all-gather overlapped with the matmul, for JAX."""
from setuptools import setup

# Logical-axis rewrites (`logical_dot_general`, Flax linen's rules) and the
# fp8 path import Flax when first used.
FLAX = ["flax>=0.12"]
# The reference host (host/reference_host: model, config loader, trainer,
# A/B harness) and its scripts.
HOST = FLAX + [
    "orbax-checkpoint>=0.11",
    "PyYAML>=6.0",
    # TensorBoard events (pure Python).
    "tensorboardX>=2.6",
]

setup(
    name="collective-matmul",
    version="0.1.0",
    description=("Drop-in dot_general that overlaps the activation all-gather "
                 "with the matmul (Pallas Mosaic GPU kernel for Hopper, "
                 "portable ring elsewhere), plus a MaxText-style host."),
    python_requires=">=3.11",
    package_dir={"": "plugin", "reference_host": "host/reference_host"},
    packages=["collective_matmul", "collective_matmul.kernels",
              "collective_matmul.selection",
              "collective_matmul.integrations",
              "collective_matmul.integrations.maxtext", "reference_host"],
    # The packaged table of measured kernel configs (selection/tuned.py).
    package_data={"collective_matmul": ["tuned_configs.json"]},
    # What `import collective_matmul` and the drop-in import; a MaxText or
    # Flax user has all of it already.
    install_requires=[
        # 0.10.2: jax.shard_map, jax.set_mesh, Explicit axes, reshard, and
        # Pallas Mosaic GPU with remote refs and global semaphores.
        "jax>=0.10.2",
        "numpy>=1.26",
        "absl-py>=2.1",
    ],
    extras_require={
        "cuda12": ["jax[cuda12]>=0.10.2"],
        "cuda13": ["jax[cuda13]>=0.10.2"],
        "flax": FLAX,
        "host": HOST,
        # The tests run the reference host too.
        "test": ["pytest>=8"] + HOST,
        # Real MaxText (collective_matmul.integrations.maxtext): MaxText
        # declares its dependencies only under extras, so this pins the set
        # the integration tests run against (Python >= 3.12, CPU).
        "maxtext": [f"{req}; python_version >= '3.12'" for req in (
            "maxtext==0.2.5", "jax==0.12.0.1", "jaxlib==0.12.0.1",
            "flax==0.12.12", "optax==0.2.8", "orbax-checkpoint==0.12.8",
            "aqtp==0.9.0", "qwix==0.1.8", "pathwaysutils==0.1.13",
            "omegaconf==2.4.0", "pydantic==2.14.4", "tokamax==0.0.17",
            "tensorboardX==2.6.5", "numpy==2.5.5", "scipy==1.18.1",
            "Jinja2==3.1.6", "huggingface_hub==2.4.0",
            "transformers==5.24.0", "grain==0.2.18", "drjax==0.2.1",
            "pillow==13.0.0", "tiktoken==0.14.0", "sentencepiece==0.2.3",
            "sympy==1.14.0", "ml_collections==1.1.0",
            # scripts/maxtext_ab.py's ab.png.
            "matplotlib>=3.8")],
        "plot": ["matplotlib>=3.8"],
    },
)
