"""Facts about the device that kernel launches are chosen and sized by: whether Triton
interprets on the CPU, the GPU's SMs and its name. torch.compile takes each as a constant
(``assume_constant_result``): a compiled forward holds the choice made with it, not the
query."""

from __future__ import annotations

import functools
import os

import torch


@torch.compiler.assume_constant_result
def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@torch.compiler.assume_constant_result
def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 4 elsewhere (the interpreter), to size grids alike."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
@torch.compiler.assume_constant_result
def card(device: torch.device) -> str:
    """The CUDA device's name (crossovers.json is keyed by it)."""
    return torch.cuda.get_device_name(device)


def aligned(t: torch.Tensor, nbytes: int) -> bool:
    """Whether t's data starts at a multiple of ``nbytes`` bytes. torch allocates a GPU
    tensor's storage aligned to far more (the caching allocator's blocks to 512 bytes), so
    its offset into the storage decides. torch.compile's tracer reads no offsets: there it
    is True, and the operators, which check the address itself, refuse a misaligned one
    when they run."""
    if torch.compiler.is_compiling():
        return True
    return t.storage_offset() * t.element_size() % nbytes == 0
