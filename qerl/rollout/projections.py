"""A decode step's projections with unmerged LoRA in few launches.

Projections that read the same input (q/k/v, gate/up) share one LoRA shrink, one launch
of their NVFP4 base projections (where the CUDA kernel runs) and one expand that adds the
adapters, sums the kernel's split-K partials and, for gate/up, applies SiLU and the
product (kernels/lora_decode.py): three launches per group, from up to ten, or two where
the NVFP4 launch runs the shrink of PEFT's fp32 adapters among its own blocks. Frozen dense
bases (BF16 LoRA) are one GEMM per group too: the engine re-points their weights into one
buffer (merge_dense). The weights are read from the modules at every call, so the fused
path sees the live adapter like PEFT's forward does.

Anything else — a LoRA variant (DoRA), several or disabled adapters, a merged layer,
ranks that differ inside a group — runs the modules' own forward, which is the reference
these kernels are tested against. More rows than the kernels hold (a prefill) run as GEMMs,
the adapters as the training forward computes them under autocast.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn
from torch.nn import functional as F

from qerl.kernels import lora_decode, nvfp4_gemv
from qerl.kernels.device_facts import interpreting
from qerl.nn import nvfp4_linear
from qerl.nn.nvfp4_linear import NVFP4Linear, grouped_partial_sums


@dataclass
class LoraParts:
    base: nn.Module
    a: torch.Tensor
    b: torch.Tensor
    scaling: float


def lora_parts(module: nn.Module) -> LoraParts | None:
    """The pieces of a vanilla, single-adapter, unmerged PEFT LoRA Linear, else None."""
    if not isinstance(module, LoraLinear) or module.disable_adapters or module.merged:
        return None
    active = [name for name in module.active_adapters if name in module.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if name in module.lora_variant or module.lora_bias.get(name, False):
        return None
    a, b = module.lora_A[name].weight, module.lora_B[name].weight
    if module.training and not isinstance(module.lora_dropout[name], nn.Identity):
        return None
    return LoraParts(module.base_layer, a, b, float(module.scaling[name]))


def merge_dense(modules: list[nn.Module]) -> None:
    """Give a group's frozen dense bases (q/k/v, gate/up: BF16 or any one float dtype) one
    buffer, each module's weight (and bias) a view of its rows, so that a decode step runs
    the group as one GEMM, as vLLM's merged linears do, with no memory added. The
    Parameters stay the modules' own (``.data`` re-pointed): the model's own forward and
    in-place writes see the same values. Trainable or mixed groups stay as they are."""
    bases = [_dense_base(m) for m in modules]
    if len(bases) < 2 or any(b is None or b.weight.requires_grad for b in bases) or \
            len({(b.weight.dtype, b.weight.device, b.in_features) for b in bases}) != 1 or \
            len({b.bias is None for b in bases}) != 1 or _merged(bases) is not None:
        return
    with torch.no_grad():
        weight = torch.cat([b.weight for b in bases])
        bias = None if bases[0].bias is None else torch.cat([b.bias for b in bases])
        first = 0
        for b in bases:
            rows = slice(first, first + b.out_features)
            b.weight.data = weight[rows]
            if bias is not None:
                b.bias.data = bias[rows]
            first += b.out_features


def _dense_base(module: nn.Module) -> nn.Linear | None:
    base = module.base_layer if isinstance(module, LoraLinear) else module
    return base if type(base) is nn.Linear else None


def _merged(bases: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The group's weight and bias as single tensors when merge_dense made them views of
    consecutive rows of one buffer (and nothing has replaced them since), else None."""
    if not all(type(b) is nn.Linear for b in bases):
        return None
    tensors = [[b.weight for b in bases]]
    if bases[0].bias is not None:
        tensors.append([b.bias for b in bases])
    out = []
    for group in tensors:
        first = group[0]
        offset = first.storage_offset()
        for t in group:
            if (t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                    or t.storage_offset() != offset or not t.is_contiguous()):
                return None
            offset += t.numel()
        rows = sum(t.shape[0] for t in group)
        out.append(first.as_strided((rows, *first.shape[1:]), first.stride()))
    return out[0], out[1] if len(out) > 1 else None


def _dense_group(bases: list[nn.Module], x2: torch.Tensor) -> list[torch.Tensor] | None:
    """The merged group's outputs from one GEMM, as column views; None if not merged."""
    merged = _merged(bases)
    if merged is None:
        return None
    out = F.linear(x2, *merged)
    return list(out.split([b.out_features for b in bases], dim=-1))


def _base_partials(bases: list[nn.Module], x2: torch.Tensor) -> list[torch.Tensor]:
    if all(isinstance(base, NVFP4Linear) for base in bases):
        return grouped_partial_sums(bases, x2)
    outs = _dense_group(bases, x2)
    if outs is not None:
        return [out[None] for out in outs]
    return [base.partial_sums(x2) if isinstance(base, NVFP4Linear) else base(x2)[None]
            for base in bases]


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _shrink_beside_bases(parts: list[LoraParts], x2: torch.Tensor
                         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The LoRA shrink and the base projections of one group. Both only read x2, and the
    shrink is a small grid that mostly waits on loads: NVFP4 bases with fp32 adapters
    (PEFT's default) run it inside their own launch (its blocks first), which saves the
    side stream's fork and join; otherwise, while a CUDA graph is captured (the decode step),
    it runs on a side stream beside the base projections, a parallel branch of the graph,
    instead of before them. Uncaptured (a prefill of up to MAX_ROWS rows, an eager step) the
    host launching the kernels sets the time at these rows, and the fork and join would
    cost it more than the overlap saves the GPU: one stream."""
    adapters, bases = [p.a for p in parts], [p.base for p in parts]
    if all(isinstance(b, NVFP4Linear) for b in bases) and nvfp4_gemv.shrinkable(
            adapters, x2.shape[1], x2.device):
        fused = nvfp4_linear.grouped_partial_sums_and_shrink(bases, x2, adapters)
        if fused is not None:
            partials, xa = fused
            return xa, partials
    if not (x2.is_cuda and torch.cuda.is_current_stream_capturing()):
        if x2.is_cuda:
            _side_stream(x2.device)  # made before a capture (the warm-up step), not in it
        return lora_decode.lora_shrink(x2, adapters), _base_partials(bases, x2)
    main, side = torch.cuda.current_stream(x2.device), _side_stream(x2.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        xa = lora_decode.lora_shrink(x2, adapters)
    partials = _base_partials(bases, x2)
    # xa's memory belongs to the side stream, which waits for this stream before its next
    # allocation: no later shrink can take it while this stream's expand still reads it.
    main.wait_stream(side)
    return xa, partials


def _many_rows(parts: list[LoraParts], x2: torch.Tensor) -> list[torch.Tensor]:
    """A group over more rows than the decode kernels take (a prefill): the bases as one
    merged GEMM or their own forward, one shrink GEMM for the group, and each adapter's
    expand a GEMM that adds into its base's output in place. The adapters' operands are in
    x2's dtype with fp32 accumulation, as the training forward computes them under autocast
    (qerl/nn/lora_linear.py); PEFT's own forward would cast x to the fp32 adapters and
    pass over the [rows, features] outputs three more times, which took half of a 7B
    prefill's kernel time."""
    bases = [p.base for p in parts]
    outs = _dense_group(bases, x2) or [base(x2) for base in bases]
    xa = F.linear(x2, torch.cat([p.a for p in parts]).to(x2.dtype))
    first = 0
    for out, p in zip(outs, parts, strict=True):
        rank = p.a.shape[0]
        out.addmm_(xa[:, first:first + rank].to(out.dtype), p.b.to(out.dtype).t(),
                   alpha=p.scaling)
        first += rank
    return outs


def project(modules: list[nn.Module], x2: torch.Tensor, silu_mul: bool = False
            ) -> list[torch.Tensor]:
    """Each module applied to the rows x2 [M, K] (inference only: outputs are written in
    place); with ``silu_mul`` (gate and up) the one output silu(gate(x2)) * up(x2)."""
    parts = [lora_parts(m) for m in modules]
    vanilla = all(p is not None for p in parts)
    fusable = (
        x2.shape[0] <= lora_decode.MAX_ROWS
        and (x2.is_cuda or interpreting())
        and vanilla
        and len({(p.a.shape, p.a.dtype, p.b.dtype) for p in parts}) == 1
        and parts[0].a.shape[0] <= lora_decode.MAX_RANK
        and parts[0].a.dtype == parts[0].b.dtype
    )
    if vanilla and x2.shape[0] > lora_decode.MAX_ROWS:
        outs = _many_rows(parts, x2)
    elif not fusable:
        outs = _dense_group(modules, x2) or [m(x2) for m in modules]
    else:
        x2 = x2.contiguous()
        xa, bases = _shrink_beside_bases(parts, x2)
        if len({base.shape[0] for base in bases}) == 1:  # one launch for the group
            return lora_decode.lora_expand_group(xa, [p.b for p in parts],
                                                 [p.scaling for p in parts], bases, x2.dtype,
                                                 silu_mul=silu_mul)
        outs = [lora_decode.lora_expand(xa, g, p.b, p.scaling, base, x2.dtype)
                for g, (p, base) in enumerate(zip(parts, bases, strict=True))]
    return [F.silu(outs[0]) * outs[1]] if silu_mul else outs
