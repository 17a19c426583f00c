"""The rollout engine's KV cache formats (``engine.kv_cache``): ``bf16``, keys and values in
the model's own dtype (bf16 on a GPU), or ``fp8``, E4M3 (torch.float8_e4m3fn) with one fp32
scale per (layer, sequence, kv head) for its keys and one for its values:
x ~= float(e4m3) * scale. Half of bf16's bytes a slot: twice the sequences in a memory
budget, and half the bytes for decode attention, which its reads of the cache bound, to
load.

The scales are fixed by the prefill, from the prompt's real tokens, and every later write
of the sequence uses them, saturating at +-E4M3_MAX. Why not the alternatives:
- A static scale per head, calibrated once: in RL the policy (its adapter, AQN's noise)
  changes every step, so a calibration goes stale; an uncalibrated one (vLLM's default,
  scale 1) saturates heads whose keys pass 448 and leaves little precision to small ones.
- A scale per written token: a scale to read per slot, in a kernel bound by its reads.
A prompt's scale follows the policy that samples, costs the decode step one load per
(sequence, kv head), and no step waits on the host: the step stays a CUDA graph.

Each scale is a power of two, the least with amax * HEADROOM <= E4M3_MAX * scale. Scaling
by a power of two is exact in fp32 and bf16: quantizing rounds once (the cast to E4M3), and
a dequantized value is the same number whether a prefill's SDPA reads it in bf16 or decode
attention folds the scale into its fp32 scores, so prefill and decode see the same keys
and values. E4M3's relative precision does not depend on the scale (3 mantissa bits from
2^-6 to 448 times it); the headroom only raises the bound under which values are
subnormal, to at most HEADROOM / (32 * E4M3_MAX) of amax (amax / scale lands in
(E4M3_MAX / (2 HEADROOM), E4M3_MAX / HEADROOM]), values whose share of a dot product is as
small. In exchange a later token rarely saturates.

Keys are measured before rotary by the norm of each rotated pair (x_i, x_{i + D/2}),
which bounds both rotated components at every position: a prompt's keys never saturate,
and a later key only where a pair's norm exceeds HEADROOM times the prompt's largest.
Values by their largest magnitude. A scale's exponent stays within [MIN_EXPONENT,
MAX_EXPONENT]: a head of zeros (amax 0) gets the smallest, so no scale is 0, NaN or Inf,
and every dequantized value is exact in bf16 and fp32.
"""

from __future__ import annotations

from typing import Literal

import torch

from qerl.formats.nvfp4 import E4M3_MAX

KV_CACHES = ("bf16", "fp8")
DEFAULT = KV_CACHES[0]
KVCacheFormat = Literal[KV_CACHES]
HEADROOM = 8.0
MIN_EXPONENT, MAX_EXPONENT = -64, 64
SCALE_BYTES = 4  # an fp32 scale


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` is an fp8 one (False on a torch without fp8)."""
    return dtype == getattr(torch, "float8_e4m3fn", None)


def power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale (fp32, an exact power of two) of a head whose largest magnitude is
    ``amax``: the least with amax * HEADROOM <= E4M3_MAX * scale, its exponent clamped."""
    exponent = torch.ceil(torch.log2(amax.float() * (HEADROOM / E4M3_MAX)))
    exponent = torch.nan_to_num(exponent, nan=0.0).clamp(MIN_EXPONENT, MAX_EXPONENT)
    # From the bits (exponent + 127 above 23 zero mantissa bits), exactly: torch.exp2 is
    # an approximation on some backends.
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def prefill_scales(k: torch.Tensor, v: torch.Tensor, real: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales [B, KVH] of a prefill's keys (before rotary) and values, k and v
    [B, T, KVH, D], over the real tokens ``real`` [B, T] (bool; not the left padding)."""
    half = k.shape[-1] // 2
    pairs = torch.hypot(k[..., :half].float(), k[..., half:].float()).amax(-1)  # [B, T, KVH]
    values = v.float().abs().amax(-1)
    real = real[..., None]
    return tuple(power_of_two_scale(torch.where(real, amax, 0.0).amax(1))
                 for amax in (pairs, values))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [B, KVH, T, D] in E4M3 at its head's ``scale`` [B, KVH], saturated at
    +-E4M3_MAX (the reference the cache-writing kernel is tested against)."""
    scaled = x.float() / scale[:, :, None, None]  # exact: a power of two
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 x [B, KVH, S, D] at ``scale`` [B, KVH] -> ``dtype`` (exact for bf16, fp32)."""
    return (x.float() * scale[:, :, None, None]).to(dtype)


def check_layer(k_cache, v_cache, k_scale, v_scale) -> bool:
    """Whether the layer's cache [B, KVH, S, D] is fp8 (with its scales [B, KVH], fp32, one
    stride for both) or not (without); else ValueError."""
    fp8 = is_fp8(k_cache.dtype)
    if fp8 != (k_scale is not None) or fp8 != (v_scale is not None):
        raise ValueError(f"an fp8 cache comes with k and v scales and another without, got a "
                         f"{k_cache.dtype} cache with scales {k_scale is not None} and "
                         f"{v_scale is not None}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the k and v caches must share a dtype, got {k_cache.dtype} and "
                         f"{v_cache.dtype}")
    if fp8 and (k_scale.shape != k_cache.shape[:2] or k_scale.dtype != torch.float32
                or v_scale.shape != k_scale.shape or v_scale.dtype != torch.float32
                or v_scale.stride() != k_scale.stride()):
        raise ValueError(f"the scales must be [B, KVH] = {list(k_cache.shape[:2])} fp32 with "
                         f"one stride, got {list(k_scale.shape)} {k_scale.dtype} "
                         f"{k_scale.stride()} and {list(v_scale.shape)} {v_scale.dtype} "
                         f"{v_scale.stride()}")
    return fp8
