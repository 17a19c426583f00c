"""Triton and CUDA kernels for NVFP4 weights and the rollout's decode step, imported as
``qerl.kernels`` (qerl/kernels links to this folder; kernels/DESIGN.md describes them).

The folder sits at the project's top level but is never imported as ``kernels``: a
top-level module of that name would shadow the PyPI package transformers probes for. It is
the ground floor: it imports nothing of qerl but its errors and number formats.
"""
