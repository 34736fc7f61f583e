"""collective_matmul: all-gather overlapped with the matmul, for JAX."""
from setuptools import setup

setup(
    name="collective-matmul",
    version="0.1.0",
    description=("Drop-in dot_general that overlaps the activation all-gather "
                 "with the matmul (Pallas Mosaic GPU kernel for Hopper, "
                 "portable ring elsewhere), plus a MaxText-style host."),
    python_requires=">=3.11",
    package_dir={"": "plugin", "reference_host": "host/reference_host"},
    packages=["collective_matmul", "collective_matmul.kernels",
              "reference_host"],
    install_requires=[
        # 0.10.2: jax.shard_map, jax.set_mesh, Explicit axes, reshard, and
        # Pallas Mosaic GPU with remote refs and global semaphores.
        "jax>=0.10.2",
        "flax>=0.12",
        "orbax-checkpoint>=0.11",
        "numpy>=1.26",
        "absl-py>=2.1",
        "PyYAML>=6.0",
    ],
    extras_require={
        "cuda12": ["jax[cuda12]>=0.10.2"],
        "cuda13": ["jax[cuda13]>=0.10.2"],
        "test": ["pytest>=8"],
        "plot": ["matplotlib>=3.8"],
    },
)
