"""E4M3 (fp8, torch.float8_e4m3fn) in the Triton kernels, on every card: read through the
hardware's conversion where the card has one (Triton's fp8e4nv type, from
compute_capability.FP8_CONVERSION_FROM) or decoded from its bits in integer operations, and
written from its bits, which every card and Triton's interpreter compute alike: the
interpreter's own fp32 -> fp8e4nv conversion gets a rounding that carries into the exponent
wrong (31.6 becomes 16, not 32) and does not saturate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels import compute_capability


@triton.jit
def e4m3_value(bits):
    """E4M3 bits (uint8) -> their values, fp32: exponent 0 is subnormal, m * 2^-9, else
    (8 + m) * 2^(e - 10). (No NaN: the kernels' E4M3 is at most 448.)"""
    b = bits.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where(b >= 128, -value, value)


@triton.jit
def e4m3_as(x, dtype: tl.constexpr, FP8: tl.constexpr):
    """E4M3 as loaded -> ``dtype``: fp8 by the hardware's conversion (FP8), or its bits
    (uint8) decoded, where the card has no conversion (``e4m3_operand``)."""
    # A constexpr branch, so that the other is not compiled (no fp8 type before sm_89).
    if FP8:  # noqa: SIM108
        value = x.to(dtype)
    else:
        value = e4m3_value(x).to(dtype)
    return value


@triton.jit
def e4m3_bits(x):
    """fp32 x -> the bits (uint8) of x in E4M3, rounded to nearest even and saturated at
    +-448, as torch's ``x.clamp(-448, 448).to(torch.float8_e4m3fn)``; NaN stays NaN."""
    u = x.to(tl.uint32, bitcast=True)
    sign = ((u >> 24) & 0x80).to(tl.uint32)
    magnitude = u & 0x7FFFFFFF
    nan = magnitude > 0x7F800000
    magnitude = tl.minimum(magnitude, 0x43E00000)  # 448.0 (an infinity too)
    # From 2^-6 (fp32 bits 0x3C800000) up: the 23 mantissa bits rounded to 3, nearest even
    # (a carry moves into the exponent, as it should), the exponent rebiased from 127 to 7.
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    # Below: multiples of 2^-9. |x| * 2^9 (exact) + 2^23 is rounded to an integer, nearest
    # even, by the fp32 add itself; the integer is then the low mantissa bits (0 to 8; 8 is
    # 2^-6's bits).
    subnormal = (magnitude.to(tl.float32, bitcast=True) * 512.0 + 8388608.0).to(
        tl.uint32, bitcast=True) & 0xF
    bits = tl.where(magnitude < 0x3C800000, subnormal, normal)
    bits = tl.where(nan, 0x7F, bits)
    return (bits | sign).to(tl.uint8)


def e4m3_operand(t: torch.Tensor) -> torch.Tensor:
    """An E4M3 tensor as the kernels read it on its device: fp8 where the hardware converts
    it, else its bits (compute_capability.converts_fp8)."""
    return t if compute_capability.converts_fp8(t.device) else t.view(torch.uint8)
