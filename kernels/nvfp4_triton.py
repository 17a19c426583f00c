"""The Triton NVFP4 kernels: fused dequantize + matmul, y = x @ deq(W)^T and dx = dy @ deq(W),
and the dequantize kernel.

The weight comes pair-interleaved (``nvfp4_layout``): the low nibbles of each 16-byte chunk
are one group of 16 weights and the high nibbles the next, so a chunk decodes elementwise
into two tensor-core operands of K = 16 with one scale each. Triton stages the packed words
through shared memory and decodes each word as the CUDA kernel does (the layout shuffles its
bits for that decode), already in the mma operand layout: a word holds four consecutive k of
each group, which is what one thread holds of a 16-bit operand (kWidth = 4), so the forward
assembles its operands in registers with no layout conversion.

Decoding (inline PTX, one word per call): the word masked, rotated or spread by a multiply
leaves four pairs of codes, each code's three magnitude bits in the exponent/mantissa of a
16-bit float and its sign in bit 15: E2M1 * 2^-126 as bf16 (code 1 lands on a subnormal) or,
shifted up three bits, E2M1 * 2^-14 as fp16; one packed multiply by the group scale (times
2^64 for bf16) makes the weight * scale exactly (both have few significant bits), and the
fp32 accumulator is multiplied once by 2^62 / global_scale (2^14 for fp16) at the end. So
the products are exact and the weight is never rounded to 16 bits before the sum: the result
equals the float64 reference to fp32 accumulation error. Triton's CPU interpreter
(TRITON_INTERPRET=1, how CI runs these kernels) has no inline PTX and computes bf16 tl.dot
wrongly, so there (``ASM`` False) the same loop decodes in Triton's integer ops and fp32
arithmetic, as the dequantize kernel always does.

Fused launches split the reduction (``SPLIT_K``, fp32 partials [SPLIT_K, M, cols] that the
caller sums) until the grid fills the GPU (``launch_config``). Which kernel runs for which
M is nvfp4_matmul's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qerl.kernels import compute_capability
from qerl.kernels import device_facts as facts
from qerl.kernels import nvfp4_layout as layout
from qerl.kernels.e4m3 import e4m3_as, e4m3_operand

MAX_SPLIT_K = 16  # so that a consumer can sum the partials unrolled (lora_decode)
# E2M1 magnitude placed as fp16 bits is E2M1 * 2^-14.
E2M1_AS_FP16_UNSCALE = tl.constexpr(16384.0)


# The word decode's constants (nvfp4_layout): in each 16-bit half a code's magnitude at
# bits 6-8 and its sign at bit 15, E2M1 * 2^-126 as bf16.
CODE_BITS = tl.constexpr(layout.CODE_BITS)
ROT_L23, ROT_H01 = tl.constexpr(layout.ROTATIONS[0]), tl.constexpr(layout.ROTATIONS[1])
SPREAD_MASK, SPREAD_MUL = tl.constexpr(layout.SPREAD[0]), tl.constexpr(layout.SPREAD[1])


def _decode_asm(fp16: bool) -> str:
    """PTX: a stored word ($8) -> its codes L0-L3 ($0-$3) times the scale $9 and H0-H3
    ($4-$7) times $10, as 16-bit floats: the CUDA kernel's decode into four pairs (8
    instructions), then one packed multiply a pair. fp16 first moves each magnitude up to
    bits 9-11: d * 9 = d | d << 3 (their bits are disjoint), then an AND keeps the
    magnitude from d << 3 and the sign from d."""
    mask = f"{layout.CODE_BITS:#010x}"
    (l23, h01), (spread, times) = layout.ROTATIONS, layout.SPREAD
    # bf16: an fma with -0 (sm_80 on, exact; mul.bf16x2 needs sm_90), as nvfp4_decode.cuh.
    mul = "mul.rn.f16x2 d{i}, d{i}, s{s};" if fp16 else "fma.rn.bf16x2 d{i}, d{i}, s{s}, z;"
    lines = ["{", ".reg .b32 d0, d1, d2, d3, s0, s1, z;", "mov.b32 z, 0x80008000;",
             "mov.b32 s0, {$9, $9};", "mov.b32 s1, {$10, $10};",
             f"and.b32 d0, $8, {mask};",
             f"shf.l.wrap.b32 d1, $8, $8, {l23};", f"and.b32 d1, d1, {mask};",
             f"shf.l.wrap.b32 d2, $8, $8, {h01};", f"and.b32 d2, d2, {mask};",
             f"and.b32 d3, $8, {spread:#010x};", f"mul.lo.u32 d3, d3, {times:#x};",
             f"and.b32 d3, d3, {mask};"]
    for i in range(4):
        if fp16:
            lines += [f"mul.lo.u32 d{i}, d{i}, 9;", f"and.b32 d{i}, d{i}, 0x8E008E00;"]
        lines += [mul.format(i=i, s=i // 2), f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, d{i};"]
    # One line: torch.compile re-emits user Triton kernels as source, where a multi-line
    # string constant breaks.
    return " ".join([*lines, "}"])


DECODE_BF16 = tl.constexpr(_decode_asm(fp16=False))
DECODE_FP16 = tl.constexpr(_decode_asm(fp16=True))
CONSTRAINTS = tl.constexpr(",".join(["=h"] * 8 + ["r", "h", "h"]))
# Scale pre-factor and accumulator post-factor per dtype (see the module docstring).
SCALE_FACTORS = {torch.bfloat16: (2.0 ** 64, 2.0 ** 62), torch.float16: (1.0, 2.0 ** 14)}


@triton.jit
def _rotl(x, s: tl.constexpr):
    return (x << s) | (x >> (32 - s))


@triton.jit
def _half_value(half):
    """A 16-bit half of a decoded pair (u32, low 16 bits) -> its E2M1 value, fp32: moved to
    fp16's placement (magnitude at 9-11: E2M1 * 2^-14, exact) and rescaled."""
    bits = ((half << 3) & 0x0E00) | (half & 0x8000)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * E2M1_AS_FP16_UNSCALE


@triton.jit
def _k_order(c0, c1, c2, c3):
    """Codes i = 0-3 of words [R, 4] -> [R, 16] in k order (k = 4 w + i)."""
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (c0.shape[0], 16))


@triton.jit
def _group_values(words):
    """Words [R, 4] as stored (int32) -> the E2M1 values (fp32) of the chunk's two groups
    [R, 16] each: the decode of _decode_asm in Triton's integer ops, a half at a time."""
    w = words.to(tl.uint32, bitcast=True)
    l01 = w & CODE_BITS
    l23 = _rotl(w, ROT_L23) & CODE_BITS
    h01 = _rotl(w, ROT_H01) & CODE_BITS
    h23 = ((w & SPREAD_MASK) * SPREAD_MUL) & CODE_BITS
    lo = _k_order(_half_value(l01 & 0xFFFF), _half_value(l01 >> 16),
                  _half_value(l23 & 0xFFFF), _half_value(l23 >> 16))
    hi = _k_order(_half_value(h01 & 0xFFFF), _half_value(h01 >> 16),
                  _half_value(h23 & 0xFFFF), _half_value(h23 >> 16))
    return lo, hi


@triton.jit
def _scaled_groups(words, s_lo, s_hi, ASM: tl.constexpr, BF16: tl.constexpr,
                   PRE: tl.constexpr, FP8: tl.constexpr):
    """Words [R, 4] as stored and scales [R] (see e4m3_as) -> (low group * s_lo, high
    group * s_hi), [R, 16] each in k order: 16-bit (x's dtype) by PTX, or fp32 under the
    interpreter."""
    if ASM:
        if BF16:
            s_lo = tl.broadcast_to((e4m3_as(s_lo, tl.float32, FP8) * PRE).to(tl.bfloat16)
                                   [:, None], words.shape)
            s_hi = tl.broadcast_to((e4m3_as(s_hi, tl.float32, FP8) * PRE).to(tl.bfloat16)
                                   [:, None], words.shape)
            c = tl.inline_asm_elementwise(DECODE_BF16, CONSTRAINTS, [words, s_lo, s_hi],
                                          dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            s_lo = tl.broadcast_to(e4m3_as(s_lo, tl.float16, FP8)[:, None], words.shape)
            s_hi = tl.broadcast_to(e4m3_as(s_hi, tl.float16, FP8)[:, None], words.shape)
            c = tl.inline_asm_elementwise(DECODE_FP16, CONSTRAINTS, [words, s_lo, s_hi],
                                          dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        lo = _k_order(c[0], c[1], c[2], c[3])
        hi = _k_order(c[4], c[5], c[6], c[7])
    else:
        lo, hi = _group_values(words)
        lo = lo * e4m3_as(s_lo, tl.float32, FP8)[:, None]
        hi = hi * e4m3_as(s_hi, tl.float32, FP8)[:, None]
    return lo, hi


@triton.jit
def _all_below(like, value, limit):
    """``value < limit`` broadcast to ``like``'s shape: Triton's interpreter cannot AND a
    scalar predicate into a block mask."""
    return like * 0 + value < limit


@triton.jit
def _chunk_words(n, p, w, stride_pt):
    """Word offsets (int32 units) of words w of chunk p of rows n in the tiled layout
    (nvfp4_layout): tile (n // 16, p // 4) of 16 rows x 16 words, row n % 16, words
    4 (p % 4) + w; ``stride_pt`` is the words from one row tile to the next."""
    return (n // 16) * stride_pt + (p // 4) * 256 + (n % 16) * 16 + (p % 4) * 4 + w


@triton.jit
def _split_range(chunks, SPLIT_K: tl.constexpr):
    per_split = tl.cdiv(chunks, SPLIT_K)
    start = tl.program_id(1) * per_split
    return start, min(chunks, start + per_split)


@triton.jit
def nvfp4_fwd_kernel(
    x_ptr, words_ptr, scale_ptr, global_scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_pt, stride_sn, stride_os, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr, BF16: tl.constexpr,
    PRE: tl.constexpr, POST: tl.constexpr, FP8: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr,
):
    """out[M, N] = x[M, K] @ deq(W[N, K])^T (+ bias). A program owns BLOCK_N rows of W and
    walks its share of K, PAIRS 16-byte chunks (2 x PAIRS groups) per iteration. It computes
    out^T = deq(W) x^T, the decoded weight as the dot's left operand as it comes out of the
    decode: a transpose of the decoded operand into the dot's right one was miscompiled
    (Triton 3.6 on sm_90: wrong results; at 64 rows no compile)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, 16)
    w = tl.arange(0, 4)
    n_ok = offs_n < N
    x_ok = rows[None, :] < M
    groups = K // 16
    start, stop = _split_range(tl.cdiv(groups, 2 * PAIRS), SPLIT_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out^T
    for c in range(start, stop):
        for i in tl.static_range(PAIRS):
            p = c * PAIRS + i
            k_lo = p * 32 + j
            if EVEN_K:
                w_ok = n_ok[:, None]
                s_lo_ok = n_ok
                s_hi_ok = n_ok
                x_lo_ok = x_ok
                x_hi_ok = x_ok
            else:  # a chunk past the end, or the padded half of the last one, reads zeros
                w_ok = n_ok[:, None] & (p * 32 + 4 * w[None, :] < K)
                s_lo_ok = n_ok & _all_below(offs_n, 2 * p, groups)
                s_hi_ok = n_ok & _all_below(offs_n, 2 * p + 1, groups)
                x_lo_ok = x_ok & (k_lo[:, None] < K)
                x_hi_ok = x_ok & (k_lo[:, None] + 16 < K)
            words = tl.load(words_ptr + _chunk_words(offs_n[:, None], p, w[None, :], stride_pt),
                            mask=w_ok, other=0)
            s_lo = tl.load(scale_ptr + offs_n * stride_sn + 2 * p, mask=s_lo_ok, other=0.0)
            s_hi = tl.load(scale_ptr + offs_n * stride_sn + 2 * p + 1, mask=s_hi_ok, other=0.0)
            x_col = x_ptr + rows[None, :] * stride_xm + k_lo[:, None]  # x^T [16, BLOCK_M]
            x_lo = tl.load(x_col, mask=x_lo_ok, other=0.0)
            x_hi = tl.load(x_col + 16, mask=x_hi_ok, other=0.0)
            w_lo, w_hi = _scaled_groups(words, s_lo, s_hi, ASM, BF16, PRE, FP8)
            if not ASM:
                x_lo = x_lo.to(tl.float32)
                x_hi = x_hi.to(tl.float32)
            acc = tl.dot(w_lo, x_lo, acc)
            acc = tl.dot(w_hi, x_hi, acc)
    acc = acc * (POST / tl.load(global_scale_ptr))
    if HAS_BIAS:  # noqa: SIM102 (a constexpr test: Triton compiles the branch away)
        if tl.program_id(1) == 0:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + tl.program_id(1) * stride_os + rows[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=x_ok & n_ok[:, None])


@triton.jit
def nvfp4_bwd_kernel(
    dy_ptr, words_ptr, scale_ptr, global_scale_ptr, out_ptr,
    M, N, K,
    stride_dym, stride_pt, stride_sn, stride_os, stride_om,
    SPLIT_K: tl.constexpr, ASM: tl.constexpr, BF16: tl.constexpr, PRE: tl.constexpr,
    POST: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[M, K] = dy[M, N] @ deq(W[N, K]). A program owns one 16-byte chunk of columns
    (32 outputs: its low-nibble group, then its high one) and reduces over N."""
    p = tl.program_id(0)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, 16)
    w = tl.arange(0, 4)
    x_ok = rows[:, None] < M
    start, stop = _split_range(tl.cdiv(N, BLOCK_N), SPLIT_K)
    acc_lo = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
    for c in range(start, stop):
        n = c * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        words = tl.load(words_ptr + _chunk_words(n[:, None], p, w[None, :], stride_pt),
                        mask=n_ok[:, None], other=0)
        s_lo = tl.load(scale_ptr + n * stride_sn + 2 * p, mask=n_ok, other=0.0)
        s_hi = tl.load(scale_ptr + n * stride_sn + 2 * p + 1,
                       mask=n_ok & _all_below(n, 2 * p + 1, K // 16), other=0.0)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + n[None, :],
                     mask=x_ok & n_ok[None, :], other=0.0)
        w_lo, w_hi = _scaled_groups(words, s_lo, s_hi, ASM, BF16, PRE, FP8)
        if not ASM:
            dy = dy.to(tl.float32)
        acc_lo = tl.dot(dy, w_lo, acc_lo)
        acc_hi = tl.dot(dy, w_hi, acc_hi)
    post = POST / tl.load(global_scale_ptr)
    out = out_ptr + tl.program_id(1) * stride_os + rows[:, None] * stride_om + p * 32 + j[None, :]
    tl.store(out, (acc_lo * post).to(out_ptr.dtype.element_ty), mask=x_ok)
    tl.store(out + 16, (acc_hi * post).to(out_ptr.dtype.element_ty),
             mask=x_ok & (p * 32 + 16 + j[None, :] < K))


@triton.jit
def nvfp4_dequant_kernel(words_ptr, scale_ptr, global_scale_ptr, out_ptr, N, K,
                         stride_pt, stride_sn, stride_on,
                         FP8: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr):
    """out[N, K] = deq(W) in out's dtype, bit for bit as nvfp4.dequantize: each weight is
    E2M1 * (scale / global_scale) in fp32, rounded once."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    p = tl.program_id(1) * PAIRS + tl.arange(0, PAIRS)
    j = tl.arange(0, 16)
    w = tl.arange(0, 4)
    rows_ok = (offs_n < N)[:, None]
    n_ok = rows_ok[:, :, None]
    groups = K // 16
    words = tl.load(words_ptr + _chunk_words(offs_n[:, None, None], p[None, :, None],
                                             w[None, None, :], stride_pt),
                    mask=n_ok & (2 * p < groups)[None, :, None], other=0)
    lo, hi = _group_values(tl.reshape(words, (BLOCK_N * PAIRS, 4)))
    s_ptr = scale_ptr + offs_n[:, None] * stride_sn + 2 * p[None, :]
    s_lo = tl.load(s_ptr, mask=rows_ok & (2 * p < groups)[None, :], other=0.0)
    s_hi = tl.load(s_ptr + 1, mask=rows_ok & (2 * p + 1 < groups)[None, :], other=0.0)
    global_scale = tl.load(global_scale_ptr)
    # Correctly rounded scale / global_scale, as the reference divides.
    w_lo = (tl.reshape(lo, (BLOCK_N, PAIRS, 16))
            * tl.math.div_rn(e4m3_as(s_lo, tl.float32, FP8), global_scale)[:, :, None])
    w_hi = (tl.reshape(hi, (BLOCK_N, PAIRS, 16))
            * tl.math.div_rn(e4m3_as(s_hi, tl.float32, FP8), global_scale)[:, :, None])
    k_lo = p[None, :, None] * 32 + j[None, None, :]
    out = out_ptr + offs_n[:, None, None] * stride_on + k_lo
    tl.store(out, w_lo.to(out_ptr.dtype.element_ty), mask=n_ok & (k_lo < K))
    tl.store(out + 16, w_hi.to(out_ptr.dtype.element_ty), mask=n_ok & (k_lo + 16 < K))



@dataclass(frozen=True)
class LaunchConfig:
    """One fused launch. ``block_c``: output columns per program (N forward; backward a
    program owns 32 columns and ``block_c`` is its reduction chunk of N). ``pairs``:
    16-byte chunks per forward iteration."""

    block_m: int
    block_c: int
    pairs: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def launch_config(op: str, m: int, n: int, k: int, num_sms: int) -> LaunchConfig:
    """Tiles of a fused launch (op: fwd | bwd) for an M x K by (N, K) weight problem, as
    sweeps chose them (kernels/DESIGN.md). Forward: 128 rows of W by 2 chunks per iteration, 4
    warps, 4 programs per SM. Backward: a program's output is only BLOCK_M x 32, which
    Triton would replicate over 4 warps, so it gets one warp per 16 rows of M and 16 warps
    per SM in all."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    if op == "fwd":
        block_c, pairs, warps, per_sm = 128, 2, 4, 4
        tiles, chunks = triton.cdiv(n, block_c), triton.cdiv(k, 32 * pairs)
    else:
        block_c, pairs, warps = 64, 1, block_m // 16
        per_sm = 16 // warps
        tiles, chunks = triton.cdiv(k, 32), triton.cdiv(n, block_c)
    # At most MAX_SPLIT_K: no slower than more splits, and a consumer of the partials can
    # sum them unrolled.
    split = max(1, min(chunks, triton.cdiv(per_sm * num_sms, tiles), MAX_SPLIT_K))
    return LaunchConfig(block_m, block_c, pairs, split, num_warps=warps,
                        num_stages=4 if op == "fwd" else 3)


def _kernel_flags(dtype: torch.dtype, device: torch.device) -> dict:
    asm = not facts.interpreting()
    pre, post = SCALE_FACTORS[dtype] if asm else (1.0, 1.0)
    return {"ASM": asm, "BF16": dtype == torch.bfloat16, "PRE": pre, "POST": post,
            "FP8": compute_capability.converts_fp8(device)}


def fused(op: str, a2, n: int, k: int, pairs, scale, global_scale, bias=None):
    """The Triton kernel's split-K partial sums [S, M, cols] of op (fwd | bwd)."""
    m = a2.shape[0]
    cfg = launch_config(op, m, n, k, facts.num_sms(a2.device))
    cols = n if op == "fwd" else k
    out_dtype = torch.float32 if cfg.split_k > 1 else a2.dtype
    out = torch.empty((cfg.split_k, m, cols), dtype=out_dtype, device=a2.device)
    words = pairs.view(torch.int32)
    strides = (a2.stride(0), words.stride(0), scale.stride(0), out.stride(0), out.stride(1))
    meta = {**_kernel_flags(a2.dtype, a2.device), "SPLIT_K": cfg.split_k, "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_c, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    m_tiles = triton.cdiv(m, cfg.block_m)
    if op == "fwd":
        grid = (triton.cdiv(n, cfg.block_c), cfg.split_k, m_tiles)
        nvfp4_fwd_kernel[grid](a2, words, e4m3_operand(scale), global_scale,
                               bias if bias is not None else global_scale, out, m, n, k,
                               *strides, HAS_BIAS=bias is not None, PAIRS=cfg.pairs,
                               EVEN_K=k % (32 * cfg.pairs) == 0, **meta)
    else:
        grid = (triton.cdiv(k, 32), cfg.split_k, m_tiles)
        nvfp4_bwd_kernel[grid](a2, words, e4m3_operand(scale), global_scale, out, m, n, k,
                               *strides, **meta)
    return out


def dequantize(pairs: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """deq(W) [N, K] in ``dtype``, in one kernel (bit-identical to nvfp4.dequantize)."""
    n, k = layout.check_layer(pairs, scale, global_scale)
    out = torch.empty((n, k), dtype=dtype, device=pairs.device)
    block_n, chunk_pairs = 32, 8
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, 32 * chunk_pairs))
    words = pairs.view(torch.int32)
    nvfp4_dequant_kernel[grid](words, e4m3_operand(scale), global_scale, out, n, k,
                               words.stride(0), scale.stride(0), out.stride(0),
                               FP8=compute_capability.converts_fp8(pairs.device),
                               BLOCK_N=block_n, PAIRS=chunk_pairs, num_warps=4)
    return out
