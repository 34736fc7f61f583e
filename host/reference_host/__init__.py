"""A MaxText-style reference host for the collective_matmul plugin.

Modules: `config` (YAML loading), `mesh`, `model` (LLaMA-style decoder),
`trainer`, `checkpoint` (orbax), `ab` (A/B harness). Importing the package
imports none of them, so scripts can set XLA_FLAGS before JAX loads.
"""
