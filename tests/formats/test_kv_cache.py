"""The fp8 KV cache's format (qerl/formats/kv_cache.py) against float64: each scale is the
least power of two with the headroom, never 0, NaN or Inf; a prefill's scales see only the
prompt's real tokens and leave every rotated key of that prompt, at any position, and every
value within E4M3_MAX / HEADROOM; quantizing rounds once, and dequantizing is exact in bf16
and fp32."""

from __future__ import annotations

import math

import pytest
import torch

from qerl.formats import kv_cache
from qerl.formats.nvfp4 import E4M3_MAX
from tests.conftest import fresh_seed

FP8 = torch.float8_e4m3fn


def is_power_of_two(x: torch.Tensor) -> torch.Tensor:
    return (x > 0) & ((x.view(torch.int32) & 0x7FFFFF) == 0)


def test_a_scale_is_the_least_power_of_two_with_the_headroom():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    amax = torch.cat([(1 + torch.rand(5000, generator=gen)) * torch.exp2(
        torch.randint(-40, 40, (5000,), generator=gen).float()),
        torch.exp2(torch.arange(-40.0, 40.0)),  # powers of two themselves
        torch.exp2(torch.arange(-40.0, 40.0)) * E4M3_MAX / kv_cache.HEADROOM])
    scale = kv_cache.power_of_two_scale(amax)
    assert is_power_of_two(scale).all(), seed
    need = amax.double() * kv_cache.HEADROOM / E4M3_MAX
    assert (need <= scale.double()).all() and (need > scale.double() / 2).all(), seed


def test_no_scale_is_zero_nan_or_infinite():
    amax = torch.tensor([0.0, 1e-45, 1e-30, float("nan"), float("inf"), 3e38])
    scale = kv_cache.power_of_two_scale(amax)
    assert is_power_of_two(scale).all() and torch.isfinite(scale).all()
    exponents = torch.log2(scale)
    assert (exponents >= kv_cache.MIN_EXPONENT).all()
    assert (exponents <= kv_cache.MAX_EXPONENT).all()
    assert scale[0] == scale[1] == 2.0 ** kv_cache.MIN_EXPONENT  # a head of zeros
    # every dequantized value of such a scale is a normal number in bf16
    assert torch.finfo(torch.bfloat16).max > E4M3_MAX * 2.0 ** kv_cache.MAX_EXPONENT
    assert torch.finfo(torch.bfloat16).tiny <= 2.0 ** -9 * 2.0 ** kv_cache.MIN_EXPONENT


def test_a_prefills_scales_bound_its_rotated_keys_and_ignore_the_padding():
    """Keys rotated at any angle (any position: rotary turns each pair (x_i, x_{i+D/2})) and
    values of the prompt's tokens stay within E4M3_MAX / HEADROOM of their scale; huge
    values in the left padding change nothing."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch, steps, kv_heads, head_dim = 3, 7, 2, 24
    k = torch.randn(batch, steps, kv_heads, head_dim, generator=gen) * 5
    v = torch.randn(batch, steps, kv_heads, head_dim, generator=gen) * 0.01
    pad = torch.tensor([0, 2, 6])
    real = torch.arange(steps)[None, :] >= pad[:, None]
    k_scale, v_scale = kv_cache.prefill_scales(k.bfloat16(), v.bfloat16(), real)
    padded_k, padded_v = k.clone(), v.clone()
    padded_k[~real], padded_v[~real] = 1e4, -1e4
    again = kv_cache.prefill_scales(padded_k.bfloat16(), padded_v.bfloat16(), real)
    assert torch.equal(again[0], k_scale) and torch.equal(again[1], v_scale), seed
    half = head_dim // 2
    x1, x2 = k.bfloat16().double()[..., :half], k.bfloat16().double()[..., half:]
    for angle in torch.rand(20, generator=gen).double() * 2 * math.pi:
        c, s = math.cos(angle), math.sin(angle)
        rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)  # [B, T, KVH, D]
        ratio = rotated.abs().amax(-1) / k_scale[:, None].double()
        assert (ratio[real] <= E4M3_MAX / kv_cache.HEADROOM * (1 + 1e-12)).all(), seed
    ratio = v.bfloat16().double().abs().amax(-1) / v_scale[:, None].double()
    assert (ratio[real] <= E4M3_MAX / kv_cache.HEADROOM).all(), seed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rounds_once_and_dequantize_is_exact(dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 3, 9, 16, generator=gen) * 3).to(dtype)  # [B, KVH, S, D]
    scale = torch.exp2(torch.randint(-8, 2, (2, 3), generator=gen).float())
    scale[0, 0] = 2.0 ** -8  # a head that saturates
    q = kv_cache.quantize(x, scale)
    quotient = x.double() / scale.double()[:, :, None, None]
    expected = quotient.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8)), seed
    assert ((q.view(torch.uint8) & 0x7F) == 0x7E).any(), seed  # some saturate
    back = kv_cache.dequantize(q, scale, dtype)
    assert back.dtype == dtype
    assert torch.equal(back.double(), q.double() * scale.double()[:, :, None, None]), seed
    normal = quotient.abs() >= 2 ** -6
    unsaturated = quotient.abs() <= E4M3_MAX
    error = (back.double() - x.double()).abs() / x.double().abs()
    assert (error[normal & unsaturated] <= 2 ** -4).all(), seed  # half of 3 mantissa bits
