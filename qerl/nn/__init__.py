"""Modules: NVFP4Linear (frozen packed weight, fused Triton kernels on CUDA)."""

from qerl.nn.nvfp4_linear import NVFP4Linear

__all__ = ["NVFP4Linear"]
