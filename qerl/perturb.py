"""A BF16 model moved as far from its weights as NVFP4 moves it, by other means: Gaussian
noise on each Linear that `qerl quantize` quantizes, with the norm of that Linear's NVFP4
error (the science study's matched-start control: does any start this much perturbed grow
reward as qerl's does?)."""

from __future__ import annotations

import torch
from torch import nn

from qerl.formats import nvfp4
from qerl.quantize import KEEP_DENSE, fusion_groups, quantize_group


def nvfp4_matched_noise(model: nn.Module, seed: int) -> dict[str, float]:
    """In place: W <- W + sigma * N(0, I) for every Linear that NVFP4 quantization takes (its
    fusion groups sharing a global scale, as `qerl quantize` writes them), sigma chosen so
    that the noise's expected norm is ||deq(q(W)) - W||. Drawn from ``seed`` and the layer's
    position, on the CPU, so the same on any device. Returns each layer's relative error
    ||deq(q(W)) - W|| / ||W||."""
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.split(".")[-1] not in KEEP_DENSE}
    position = {name: i for i, name in enumerate(linears)}
    relative = {}
    with torch.no_grad():
        for group in fusion_groups(list(linears)):
            quantized, _ = quantize_group({n: linears[n].weight.float() for n in group})
            for name, q in quantized.items():
                w = linears[name].weight
                error = (nvfp4.dequantize(q, torch.float32) - w.float()).norm()
                relative[name] = (error / w.float().norm()).item()
                gen = torch.Generator().manual_seed(seed * 1_000_003 + position[name])
                noise = torch.randn(w.shape, generator=gen) * (error.item() / w.numel() ** 0.5)
                w.copy_((w.float() + noise.to(w.device)).to(w.dtype))
    return relative
