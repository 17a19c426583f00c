"""Rounding to a 16-bit float inside a kernel, kept as fp32.

Torch computes a 16-bit op in fp32 and rounds its result; matching it bit for bit means
rounding where it does. A ``x.to(tl.bfloat16).to(tl.float32)`` round trip does not
survive compilation (a rotary written so lands one ulp off torch in many outputs, as if the
intermediate roundings were dropped), so bf16 is rounded with integer operations — round to
nearest even on the upper 16 bits — which no float simplification touches.
"""

import triton
import triton.language as tl


@triton.jit
def round_as(x, dtype: tl.constexpr):
    """fp32 x rounded to ``dtype`` (bfloat16, float16 or float32), as fp32."""
    if dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x

