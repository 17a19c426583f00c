"""Attention of one decode step over the KV cache, split over the slots ("flash-decoding").

cuDNN's SDPA runs one CTA per (sequence, kv head): 64 CTAs at batch 16 for a 7B model (4 kv
heads) on a 132-SM card, which leaves half the card idle and cannot draw the bandwidth
that reading the keys and values needs; with a mask it also reads every slot of the cache.
Here the live slots of each (sequence, kv head) are spread over NSPLIT programs, about 3 per
SM in all, in two kernels:

    split:   program (b * KVH + kv head, split) takes the G = H / KVH query heads sharing its
             kv head (rows of one tl.dot) over its share of the live slots pad[b] .. slot,
             and writes its online-softmax state (max m, sum l, unnormalized output) in fp32
    combine: one program per query head rescales the NSPLIT states to their common max and
             writes sum(acc) / sum(l) in q's dtype

The share is cut at run time from ``pad`` and ``slot`` (both read on the device, so a CUDA
graph captured at one slot replays at the next): every program gets ceil(live / NSPLIT)
slots, however long the left padding or the empty tail of the 256-slot bucket is. NSPLIT
itself is fixed on the host from the span and the batch, as a graph needs. Slots outside
pad[b] .. slot are never loaded, so whatever they hold cannot leak. The partition depends
only on (pad, slot), so every run gives the same bits.

Scores are taken in base 2 (q k^T * scale * log2 e, then exp2), as flash attention does;
the probabilities are rounded to v's dtype before p @ v, as there too.

An fp8 cache (qerl/formats/kv_cache.py) is read as E4M3 and converted to q's dtype, exactly
(kernels/e4m3.py); its power-of-two scales, one per (sequence, kv head) and so one a
program, multiply the scores and the partial output instead of every element. Scaling by
a power of two is exact, so that is attention over the dequantized cache, the values a
prefill's SDPA reads, with half the bytes to load.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from qerl.formats import kv_cache
from qerl.kernels.device_facts import interpreting, num_sms
from qerl.kernels.e4m3 import e4m3_as, e4m3_operand
from qerl.kernels.rounding import round_as

WAVES = 3  # programs per SM that the split aims at
MAX_SPLITS = 64  # the combine holds all of a head's partials at once: [MAX_SPLITS, D] fp32
MAX_HEAD_DIM = 256


@triton.jit
def decode_split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pad_ptr, slot_ptr, m_ptr, l_ptr,
                        acc_ptr, KVH, G, S, qk_scale, stride_qb, stride_qh, stride_pad,
                        stride_cb, stride_ch, stride_cs, stride_sb, stride_sh,
                        D: tl.constexpr, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
                        FP32_DOTS: tl.constexpr, QUANTIZED: tl.constexpr, FP8: tl.constexpr):
    """Program (b * KVH + kv head, split): partials of rows b * H + kv head * G + g, split
    ``split``, in workspaces [B * H, NSPLIT] (m, l) and [B * H, NSPLIT, D] (acc).
    QUANTIZED: the cache is E4M3 (FP8: read by the hardware's conversion, else as bits)
    with scales [B, KVH] at ks_ptr and vs_ptr."""
    bh = tl.program_id(0).to(tl.int64)  # int64: offsets into caches over 2^31 elements
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    b = bh // KVH
    kv_head = bh % KVH
    # Clamped to the span, as the reference's mask is: a slot past it (a graph replayed
    # beyond its bucket) must not read past the view.
    first = tl.maximum(tl.load(pad_ptr + b * stride_pad).to(tl.int64), 0)
    last = tl.minimum(tl.load(slot_ptr).to(tl.int64) + 1, S)  # exclusive
    share = tl.cdiv(tl.maximum(last - first, 0), splits)
    start = first + split * share
    stop = tl.minimum(last, start + share)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    g_ok = g < G
    q = tl.load(q_ptr + b * stride_qb + (kv_head * G + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0)
    k_head = k_ptr + b * stride_cb + kv_head * stride_ch
    v_head = v_ptr + b * stride_cb + kv_head * stride_ch
    if QUANTIZED:  # the keys' scale into the scores', exactly (a power of two)
        qk_scale = qk_scale * tl.load(ks_ptr + b * stride_sb + kv_head * stride_sh)
    m = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, D), dtype=tl.float32)
    # Every tile starts at a live slot, so each row's running max is finite after the
    # first one, and exp2(m - m_new) never meets -inf - -inf.
    for s0 in range(start, stop, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        live = s < stop
        at = s[:, None] * stride_cs + d[None, :]
        k = tl.load(k_head + at, mask=live[:, None], other=0.0)
        v = tl.load(v_head + at, mask=live[:, None], other=0.0)
        if QUANTIZED:
            k, v = e4m3_as(k, q.dtype, FP8), e4m3_as(v, q.dtype, FP8)
        if FP32_DOTS:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)),
                            input_precision="ieee") * qk_scale
        else:
            scores = tl.dot(q, tl.trans(k)) * qk_scale
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        if FP32_DOTS:  # p rounded to v's dtype all the same, as the 16-bit dot does
            acc = tl.dot(round_as(p, v.dtype), v.to(tl.float32), acc * alpha[:, None],
                         input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m = m_new

    if QUANTIZED:
        acc = acc * tl.load(vs_ptr + b * stride_sb + kv_head * stride_sh)
    # A split with no live slot stores m = -inf, l = 0, acc = 0: the combine skips it.
    row = (b * KVH + kv_head) * G + g  # = b * H + q head
    part = row * splits + split
    tl.store(m_ptr + part, m, mask=g_ok)
    tl.store(l_ptr + part, total, mask=g_ok)
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def decode_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, SPLITS, D: tl.constexpr,
                          SPLITS_PAD: tl.constexpr):
    """Program r = b * H + q head: out[r] = sum_i 2^(m_i - M) acc_i / sum_i 2^(m_i - M) l_i,
    M the largest m_i; 0 when no split saw a live slot."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    ok = i < SPLITS
    part = row * SPLITS + i
    m = tl.load(m_ptr + part, mask=ok, other=float("-inf"))
    total = tl.load(l_ptr + part, mask=ok, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    top = tl.max(m, axis=0)
    # All splits empty: 2^(-inf - 0) = 0, where -inf - -inf would be NaN.
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(m - top)  # an empty split (m = -inf) weighs 0
    norm = tl.sum(w * total, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(norm > 0, norm, 1.0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))


def launch_shape(span: int, rows: int, sms: int) -> tuple[int, int]:
    """(NSPLIT, BLOCK_S) for a cache of ``span`` slots and ``rows`` = B * KVH: about WAVES
    programs per SM, no more splits than 32-slot tiles of the span (nor MAX_SPLITS); 32-slot
    tiles while a split's share of the span is at most 64 slots, where a half-empty 64-slot
    tile costs more than two 32-slot ones, else 64."""
    splits = max(1, min(triton.cdiv(WAVES * sms, max(rows, 1)), MAX_SPLITS,
                        triton.cdiv(span, 32)))
    return splits, 32 if triton.cdiv(span, splits) <= 64 else 64


def supports(head_dim: int) -> bool:
    """Whether the kernel takes heads of this size: a power of two from 16 to
    MAX_HEAD_DIM (tl.dot tiles)."""
    return 16 <= head_dim <= MAX_HEAD_DIM and not head_dim & (head_dim - 1)


def _check(q, k_cache, v_cache, pad, slot, k_scale, v_scale) -> bool:
    """Whether the cache is fp8 (kv_cache.check_layer); ValueError for what the kernels
    cannot take."""
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be [B, H, 1, D] (one decode step), got {tuple(q.shape)}")
    batch, heads, _, head_dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"the k and v caches must both be [B, KVH, S, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(f"the cache {tuple(k_cache.shape)} does not match q "
                         f"{tuple(q.shape)} (batch and head_dim)")
    if not supports(head_dim):
        raise ValueError(f"head_dim must be a power of two from 16 to {MAX_HEAD_DIM} "
                         f"(tl.dot tiles), got {head_dim}")
    if heads % k_cache.shape[1]:
        raise ValueError(f"the {heads} query heads do not share the {k_cache.shape[1]} kv "
                         f"heads evenly (H % KVH != 0)")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"the k and v caches must share strides, got {k_cache.stride()} "
                         f"and {v_cache.stride()}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("the last dim (head_dim) of q and of the caches must have stride 1")
    fp8 = kv_cache.check_layer(k_cache, v_cache, k_scale, v_scale)
    if fp8 and q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q must be fp32, bf16 or fp16 over an fp8 cache, got {q.dtype}")
    if not fp8 and not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if pad.shape != (batch,) or pad.dtype != torch.int64:
        raise ValueError(f"pad must be [B] = [{batch}] int64, got {tuple(pad.shape)} "
                         f"{pad.dtype}")
    if slot.dim() != 0 or slot.dtype != torch.int64:
        raise ValueError(f"slot must be a 0-dim int64 tensor, got {tuple(slot.shape)} "
                         f"{slot.dtype}")
    scales = (k_scale, v_scale) if fp8 else ()
    devices = {t.device for t in (q, k_cache, v_cache, pad, slot, *scales)}
    if len(devices) != 1:
        raise ValueError(f"q, the caches (their scales), pad and slot must be on one device, "
                         f"got {devices}")
    return fp8


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     pad: torch.Tensor, slot: torch.Tensor, scale: float, *,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     splits: int | None = None) -> torch.Tensor:
    """q [B, H, 1, D], the layer's cache [B, KVH, S, D] (any strides, last one 1; an fp8
    one with its scales [B, KVH]), pad [B] int64, slot a 0-dim int64 tensor (device): the
    query of each sequence attends over slots pad[b] <= s <= slot -> [B, H, 1, D] in q's
    dtype. ``splits`` (NSPLIT) overrides the launch policy (tests)."""
    fp8 = _check(q, k_cache, v_cache, pad, slot, k_scale, v_scale)
    batch, heads, _, head_dim = q.shape
    kv_heads, span = k_cache.shape[1:3]
    group = heads // kv_heads
    rows = batch * kv_heads
    nsplit, block_s = launch_shape(span, rows, num_sms(q.device))
    if splits is not None:
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"splits must be 1 to {MAX_SPLITS}, got {splits}")
        nsplit = splits
    out = torch.empty((batch, heads, 1, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    m = torch.empty((batch * heads, nsplit), dtype=torch.float32, device=q.device)
    sums = torch.empty_like(m)
    acc = torch.empty((batch * heads, nsplit, head_dim), dtype=torch.float32,
                      device=q.device)
    # fp32 dots (not TF32) for fp32, and under the interpreter, which computes 16-bit
    # tl.dot wrongly (as kernels/lora_decode.py notes).
    fp32_dots = q.dtype == torch.float32 or interpreting()
    if fp8:
        k_cache, v_cache = e4m3_operand(k_cache), e4m3_operand(v_cache)
    scales = (k_scale, v_scale, *k_scale.stride()) if fp8 else (pad, pad, 0, 0)  # unread
    decode_split_kernel[(rows, nsplit)](
        q, k_cache, v_cache, *scales[:2], pad, slot, m, sums, acc, kv_heads, group, span,
        scale * math.log2(math.e), q.stride(0), q.stride(1), pad.stride(0),
        *k_cache.stride()[:3], *scales[2:], D=head_dim,
        G_PAD=max(16, triton.next_power_of_2(group)), BLOCK_S=block_s, FP32_DOTS=fp32_dots,
        QUANTIZED=fp8, FP8=fp8 and k_cache.dtype != torch.uint8, num_warps=4, num_stages=2)
    # A combine program holds SPLITS_PAD x D fp32: one warp up to 8 x 128 of them (four
    # warps were slower on so little work), more only to avoid spills.
    splits_pad = triton.next_power_of_2(nsplit)
    decode_combine_kernel[(batch * heads,)](
        m, sums, acc, out, nsplit, D=head_dim, SPLITS_PAD=splits_pad,
        num_warps=min(4, max(1, splits_pad * head_dim // 1024)))
    return out


def reference_decode_attention(q, k_cache, v_cache, pad, slot, scale, k_scale=None,
                               v_scale=None) -> torch.Tensor:
    """The same with torch's scaled_dot_product_attention and a boolean mask (the
    reference), over an fp8 cache dequantized."""
    if kv_cache.check_layer(k_cache, v_cache, k_scale, v_scale):
        k_cache = kv_cache.dequantize(k_cache, k_scale, q.dtype)
        v_cache = kv_cache.dequantize(v_cache, v_scale, q.dtype)
    s = torch.arange(k_cache.shape[2], device=q.device)
    visible = (s[None, :] >= pad[:, None]) & (s[None, :] <= slot)
    return F.scaled_dot_product_attention(q, k_cache, v_cache,
                                          attn_mask=visible[:, None, None], scale=scale,
                                          enable_gqa=q.shape[1] != k_cache.shape[1])
