"""Triton kernels for NVFP4 weights, imported as ``qerl.kernels``.

The folder sits at the project's top level but is installed under ``qerl`` (see
pyproject.toml): transformers probes for a PyPI package named ``kernels``, which a
top-level module of that name would shadow.
"""
