"""Rotary embedding of queries and keys, and the keys and values written into the KV cache,
in one kernel.

Hugging Face applies rotary as q * cos + rotate_half(q) * sin on 16-bit tensors (a slice,
a negation, a concatenation, three products and a sum, for q and for k), then a cache
update: a dozen kernels per layer and step. This one reads each head once and rounds where
theirs does (after each product and after the sum), so its numbers are theirs.

Rows are tokens m = b * T + t of a [B, T] batch; token t goes to cache slot ``slots[t]``.

An fp8 cache (qerl/formats/kv_cache.py) takes each key and value divided by its (sequence,
kv head)'s power-of-two scale (exact) and rounded once, to E4M3 (kernels/e4m3.py), where a
bf16 one takes it as it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.formats import kv_cache
from qerl.kernels.e4m3 import e4m3_bits
from qerl.kernels.rounding import round_as


@triton.jit
def _rotate(x_ptr, cos_ptr, sin_ptr, HALF, BLOCK: tl.constexpr):
    """The two rotated halves of one head (fp32 holding values of x's dtype)."""
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    x1 = tl.load(x_ptr + i, mask=ok, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(x_ptr + HALF + i, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + i, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + HALF + i, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + i, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + HALF + i, mask=ok, other=0.0).to(tl.float32)
    # Rounded where the 16-bit torch ops round: each product, then the sum.
    lo = round_as(round_as(x1 * c1, dt) + round_as(-x2 * s1, dt), dt)
    hi = round_as(round_as(x2 * c2, dt) + round_as(x1 * s2, dt), dt)
    return lo.to(dt), hi.to(dt), i, ok


@triton.jit
def _store(ptr, x, scale_ptr, ok, FP8: tl.constexpr):
    """x (a head's half) into the cache: as it is, or its E4M3 bits at the head's scale."""
    if FP8:
        x = e4m3_bits(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)))
    tl.store(ptr, x, mask=ok)


@triton.jit
def rotary_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr,
                        kc_ptr, vc_ptr, ks_ptr, vs_ptr, T, HEADS, HALF,
                        stride_q, stride_k, stride_v, stride_cs,
                        stride_qb, stride_qh, stride_qt,
                        stride_cb, stride_ch, stride_cs_slot, stride_sb, stride_sh,
                        BLOCK: tl.constexpr, FP8: tl.constexpr):
    m = tl.program_id(0)
    h = tl.program_id(1)
    b = m // T
    t = m % T
    cos = cos_ptr + m.to(tl.int64) * stride_cs
    sin = sin_ptr + m.to(tl.int64) * stride_cs
    if h < HEADS:
        lo, hi, i, ok = _rotate(q_ptr + m.to(tl.int64) * stride_q + h * 2 * HALF, cos, sin,
                                HALF, BLOCK)
        out = q_out_ptr + b * stride_qb + h * stride_qh + t * stride_qt
        tl.store(out + i, lo, mask=ok)
        tl.store(out + HALF + i, hi, mask=ok)
    else:
        kh = h - HEADS
        slot = tl.load(slots_ptr + t)
        dest = b.to(tl.int64) * stride_cb + kh * stride_ch + slot * stride_cs_slot
        scale = b * stride_sb + kh * stride_sh
        lo, hi, i, ok = _rotate(k_ptr + m.to(tl.int64) * stride_k + kh * 2 * HALF, cos, sin,
                                HALF, BLOCK)
        _store(kc_ptr + dest + i, lo, ks_ptr + scale, ok, FP8)
        _store(kc_ptr + dest + HALF + i, hi, ks_ptr + scale, ok, FP8)
        v_row = v_ptr + m.to(tl.int64) * stride_v + kh * 2 * HALF
        _store(vc_ptr + dest + i, tl.load(v_row + i, mask=ok), vs_ptr + scale, ok, FP8)
        _store(vc_ptr + dest + HALF + i, tl.load(v_row + HALF + i, mask=ok), vs_ptr + scale,
               ok, FP8)


def rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, slots, k_scale=None,
                      v_scale=None) -> torch.Tensor:
    """q [B, T, H*D], k and v [B, T, KVH*D], cos and sin [B, T, D], the layer's cache
    [B, KVH, S, D] (any strides, last one 1), slots [T]: write the rotated keys and the
    values at ``slots``; return the rotated queries [B, H, T, D]. An fp8 cache comes with
    its scales [B, KVH] (fp32)."""
    batch, steps, kv_heads, _, head_dim = (*q.shape[:2], *k_cache.shape[1:])
    heads = q.shape[-1] // head_dim
    if head_dim % 2 or q.shape[-1] != heads * head_dim or k.shape[-1] != kv_heads * head_dim:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} do not split into heads "
                         f"of the cache's head_dim {head_dim}")
    if cos.shape != (batch, steps, head_dim) or v.shape != k.shape or slots.shape != (steps,):
        raise ValueError("cos/sin must be [B, T, head_dim], v like k, slots [T]")
    q2, k2, v2 = (t.reshape(batch * steps, -1) for t in (q, k, v))
    c2, s2 = cos.reshape(batch * steps, head_dim), sin.reshape(batch * steps, head_dim)
    if c2.stride() != s2.stride() or k_cache.stride() != v_cache.stride():
        raise ValueError("cos and sin (and the two caches) must share strides")
    if min(t.stride(-1) for t in (q2, k2, v2, c2, k_cache)) != 1:
        raise ValueError("the last dim of every tensor must be contiguous")
    fp8 = kv_cache.check_layer(k_cache, v_cache, k_scale, v_scale)
    q_out = torch.empty((batch, heads, steps, head_dim), dtype=q.dtype, device=q.device)
    half = head_dim // 2
    if fp8:  # written as bits (kernels/e4m3.py)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    scales = (k_scale, v_scale, *k_scale.stride()) if fp8 else (slots, slots, 0, 0)  # unread
    rotary_cache_kernel[(batch * steps, heads + kv_heads)](
        q2, k2, v2, c2, s2, slots, q_out, k_cache, v_cache, *scales[:2], steps, heads, half,
        q2.stride(0), k2.stride(0), v2.stride(0), c2.stride(0), *q_out.stride()[:3],
        *k_cache.stride()[:3], *scales[2:], BLOCK=triton.next_power_of_2(half), FP8=fp8,
        num_warps=1)
    return q_out


def reference_rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, slots, apply_rotary,
                                k_scale=None, v_scale=None):
    """The same with the model family's ``apply_rotary_pos_emb`` and index_copy_ (an fp8
    cache's keys and values quantized by qerl/formats/kv_cache.py)."""
    batch, steps = q.shape[:2]
    head_dim = k_cache.shape[-1]
    shape = (batch, steps, -1, head_dim)
    q, k = apply_rotary(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), cos, sin)
    v = v.view(shape).transpose(1, 2)
    if kv_cache.check_layer(k_cache, v_cache, k_scale, v_scale):
        # Copied as bytes: torch has no index_copy_ of fp8.
        k, v, k_cache, v_cache = (t.view(torch.uint8) for t in (
            kv_cache.quantize(k, k_scale), kv_cache.quantize(v, v_scale), k_cache, v_cache))
    k_cache.index_copy_(2, slots, k)
    v_cache.index_copy_(2, slots, v)
    return q
