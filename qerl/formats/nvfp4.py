"""NVFP4 exactly as llmcompressor's NVFP4A16 recipe writes it (compressed-tensors'
``nvfp4-pack-quantized`` format).

A weight W [N, K] becomes
- codes: 4-bit E2M1 (bits 0-2 index the magnitude in ``E2M1_VALUES``, bit 3 the sign),
  two per byte, the even element in the low nibble: ``packed`` uint8 [N, K/2];
- ``scale``: one FP8-E4M3 scale per 16 consecutive weights of a row, [N, K/16];
- ``global_scale``: one FP32 number [1], a *divisor*: W ~= e2m1 * float(scale) / global_scale.

Two divisions happen in the weight's own dtype, as llmcompressor does them: ``2688 / amax``
for the global scale and ``amax_block / 6`` for the block scale. Doing them in fp32 changes
about 1% of the bytes of a bf16 checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl.errors import GroupSizeError, QuantizationError

GROUP_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# compressed-tensors replaces a block scale that rounds to 0 in FP8 by this (its "eps").
ZERO_SCALE_REPLACEMENT = 0.125
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SIGN_BIT = 8

# Round to nearest E2M1 magnitude, ties to even: the ties at 0.25, 1.25, 2.5 and 5 go down
# (to 0, 1, 2, 4) and those at 0.75, 1.75 and 3.5 go up (to 1, 2, 4).
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)


@dataclass(frozen=True)
class NVFP4Tensor:
    """A packed NVFP4 weight, as stored in a compressed-tensors checkpoint."""

    packed: torch.Tensor  # [N, K/2] uint8
    scale: torch.Tensor  # [N, K/16] float8_e4m3fn
    global_scale: torch.Tensor  # [1] float32, a divisor

    def __post_init__(self) -> None:
        check_packed(self.packed, self.scale, self.global_scale)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        return NVFP4Tensor(
            self.packed.to(device), self.scale.to(device), self.global_scale.to(device)
        )


def check_packed(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> None:
    """Raise QuantizationError unless the three tensors form one NVFP4 weight."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise QuantizationError(
            f"weight_packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    n, half_k = packed.shape
    if (2 * half_k) % GROUP_SIZE:
        raise QuantizationError(f"K = {2 * half_k} is not a multiple of {GROUP_SIZE}")
    check_scales(scale, global_scale, n, 2 * half_k)


def check_scales(scale: torch.Tensor, global_scale: torch.Tensor, n: int, k: int) -> None:
    """Raise QuantizationError unless ``scale`` and ``global_scale`` fit an [n, k] weight."""
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // GROUP_SIZE):
        raise QuantizationError(
            f"weight_scale must be float8_e4m3fn of shape {(n, k // GROUP_SIZE)} for a "
            f"weight of shape {(n, k)}, got {scale.dtype} {tuple(scale.shape)}"
        )
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise QuantizationError(
            f"weight_global_scale must be one float32, got {global_scale.dtype} "
            f"{tuple(global_scale.shape)}"
        )


def check_weight(weight: torch.Tensor, name: str = "weight") -> None:
    """Raise QuantizationError, naming ``name``, unless ``weight`` can be quantized."""
    if weight.dim() != 2:
        raise QuantizationError(f"{name}: expected a 2-D weight, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise QuantizationError(f"{name}: expected a floating-point weight, got {weight.dtype}")
    if not torch.isfinite(weight).all():
        bad = (~torch.isfinite(weight)).sum().item()
        raise QuantizationError(f"{name}: {bad} NaN/Inf value(s) in the weight")
    if weight.shape[1] % GROUP_SIZE:
        raise GroupSizeError(
            f"{name}: input dim K = {weight.shape[1]} is not a multiple of {GROUP_SIZE}"
        )


def shared_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """The shared FP32 global scale [1] of one or more weights (q/k/v or gate/up fused).

    ``2688 / amax`` is computed in the weights' dtype (llmcompressor's generate_gparam); an
    all-zero weight gets 1.0 (its division overflows to inf, which it maps to 1).
    """
    amax = torch.stack([w.detach().abs().amax() for w in weights]).amax()
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    scale = (E4M3_MAX * E2M1_MAX) / amax
    scale = torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0)
    return scale.to(torch.float32).reshape(1)


def block_scales(weight: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """FP8-E4M3 scale per 16 weights: [N, K] -> [N, K/16]."""
    n, k = weight.shape
    amax = weight.detach().reshape(n, k // GROUP_SIZE, GROUP_SIZE).abs().amax(dim=-1)
    # amax / 6 in weight.dtype, divided by a tensor on amax's device: CUDA divides by a Python
    # number as a multiply by its reciprocal, 1 ulp off the CPU's quotient, and that ulp
    # rounds an exact FP8 tie (common for bf16-valued weights) the other way.
    six = torch.tensor(E2M1_MAX, dtype=amax.dtype, device=amax.device)
    scale = global_scale.to(weight.device) * (amax / six)
    scale = scale.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    zero = scale.to(torch.float32) == 0
    return torch.where(zero, torch.full_like(scale, ZERO_SCALE_REPLACEMENT), scale)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to E2M1 codes (uint8, sign in bit 3), saturating at +-6."""
    mag = x.abs().clamp(max=E2M1_MAX)
    down = torch.tensor(_TIES_DOWN, dtype=mag.dtype, device=mag.device)
    up = torch.tensor(_TIES_UP, dtype=mag.dtype, device=mag.device)
    # Counting thresholds strictly below |x| (ties down) and at-or-below |x| (ties up).
    code = torch.bucketize(mag, down, right=False, out_int32=True)
    code += torch.bucketize(mag, up, right=True, out_int32=True)
    code = code.to(torch.uint8)
    # A negative value that rounds to 0 keeps its sign (code 8), as compressed-tensors writes.
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode E2M1 codes (uint8) to floats."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
    values = table[(codes & 7).long()]
    return torch.where((codes & SIGN_BIT).bool(), -values, values)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes -> [N, K/2] bytes, the even element in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes -> [N, K] codes."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def quantize(
    weight: torch.Tensor, global_scale: torch.Tensor | None = None, name: str = "weight"
) -> NVFP4Tensor:
    """Quantize a [N, K] weight; pass ``global_scale`` to share one across fused layers."""
    check_weight(weight, name)
    weight = weight.detach()
    if global_scale is None:
        global_scale = shared_global_scale(weight)
    # A copy per layer: fused layers store equal but separate global scales.
    global_scale = global_scale.to(device=weight.device, dtype=torch.float32, copy=True)
    scale = block_scales(weight, global_scale)
    n, k = weight.shape
    divisor = scale.to(torch.float32) / global_scale  # [N, K/16], as compressed-tensors divides
    x = weight.reshape(n, k // GROUP_SIZE, GROUP_SIZE).to(torch.float32) / divisor.unsqueeze(-1)
    return NVFP4Tensor(pack(e2m1_codes(x).reshape(n, k)), scale, global_scale)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[N, K] weight in ``dtype``, computed in fp32 like compressed-tensors' decompression."""
    n, k = t.shape
    values = e2m1_values(unpack(t.packed)).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    divisor = t.scale.to(torch.float32) / t.global_scale.to(torch.float32)
    return (values * divisor.unsqueeze(-1)).reshape(n, k).to(dtype)
