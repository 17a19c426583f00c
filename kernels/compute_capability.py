"""The compute capability the kernels are chosen for: the card's own, or an older one that
QERL_KERNEL_ARCH names (``sm_89``, ``sm_80``). Every choice that depends on it (which
kernel runs at which M: the CUDA kernel needs sm_80, the Hopper GEMM sm_90; how the Triton
kernels read the fp8 block scales) is then made as on such a card, so that a Hopper card
runs the paths an RTX 4090 or an A100 takes.

Each kernel is still compiled for the card it runs on, so what this cannot show is a kernel
that fails to compile or computes differently on the older card itself: tests/kernels
compile the Triton kernels for sm_80, sm_86 and sm_89 on the CPU, and the CUDA kernel is
built for the named architecture as well as the card's own (a build that fails is a path
the card does not take).
"""

from __future__ import annotations

import os
import re

import torch

from qerl.errors import QuantizationError

VARIABLE = "QERL_KERNEL_ARCH"
# The first architecture that converts E4M3 in hardware (Triton's fp8e4nv type); the
# kernels decode the scales' bits in integer operations on older ones.
FP8_CONVERSION_FROM = 89


def named() -> int | None:
    """The compute capability QERL_KERNEL_ARCH names (sm_89, 89 or 8.9 -> 89; sm_100);
    None where it is unset."""
    value = os.environ.get(VARIABLE, "").strip()
    if not value:
        return None
    found = re.fullmatch(r"(?:sm_?)?(\d{2,3})|(\d{1,2})\.(\d)", value)
    if found is None:
        raise QuantizationError(f"{VARIABLE} takes a compute capability such as sm_89 or "
                                f"sm_80, got {value!r}")
    return int(found[1] or found[2] + found[3])


def chosen_for(device: torch.device) -> str:
    """The architecture (e.g. "90") the kernels are chosen for on the CUDA ``device``: its
    own, or the older one QERL_KERNEL_ARCH names."""
    major, minor = torch.cuda.get_device_capability(device)
    own, arch = major * 10 + minor, named()
    if arch is None:
        return str(own)
    if arch > own:
        raise QuantizationError(f"{VARIABLE}=sm_{arch} names a newer architecture than "
                                f"{device}'s sm_{own}: only an older card's choices can be "
                                "made here")
    return str(arch)


def converts_fp8(device: torch.device) -> bool:
    """Whether the Triton kernels read the fp8 scales through the hardware's conversion
    (from FP8_CONVERSION_FROM on; under Triton's interpreter unless QERL_KERNEL_ARCH names
    an older card) or decode their bits in integer operations."""
    arch = int(chosen_for(device)) if device.type == "cuda" else named()
    return arch is None or arch >= FP8_CONVERSION_FROM
