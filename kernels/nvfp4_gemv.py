"""The small-M NVFP4 matmul in CUDA C++ (nvfp4_gemv.cu) as the PyTorch operator
``qerl::nvfp4_gemv``: its schema and fake implementation are defined here, so
torch.compile and fake tensors see it on any machine; the library nvcc builds once per GPU
architecture registers its CUDA implementation when it is loaded. It launches on torch's
current stream, so it is captured in CUDA graphs like any kernel.

Rollouts decode a handful of tokens at a time: there the matmul reads the 4-bit weight
once and does little else, so its speed is the speed of the weight read and the decode.
The Triton kernel (nvfp4_triton.py) moves W through shared memory into operand registers,
and those instructions, not the bytes, bound it; this one loads each thread's tensor-core
fragments straight into registers (kernels/DESIGN.md, "nvfp4_gemv").

cuda_build compiles it (cached, ahead of use with ``python -m qerl.kernels.cuda_build``).
``available()`` is False (with ``unavailable_reason()``) where there is no nvcc or the
GPU is older than Ampere; the Triton kernel then runs instead, with a warning.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from qerl.errors import QuantizationError
from qerl.kernels import cuda_build
from qerl.kernels import device_facts as facts

SOURCE = Path(__file__).with_name("nvfp4_gemv.cu")
MAX_M = 32  # four 8-token tiles
MAX_SPLITS = 16  # as the Triton kernel: a consumer sums the partials unrolled
SHARED_X_ABOVE = 8  # rows above which a block's warps share x and one K range (shared_x)
log = logging.getLogger(__name__)


torch.library.define(
    "qerl::nvfp4_gemv",
    "(Tensor x, Tensor[] pairs, Tensor[] scale, Tensor[] global_scale, Tensor?[] bias, "
    "int splits, int k_warps, Tensor[] lora_a) -> (Tensor, Tensor)")


@torch.library.register_fake("qerl::nvfp4_gemv")
def _fake(x, pairs, scale, global_scale, bias, splits, k_warps, lora_a):
    """What the CUDA implementation returns (nvfp4_gemv.cu): the partial sums [splits, M,
    sum of N] (fp32 where splits > 1, else x's dtype) and the LoRA shrink's fp32 partial
    sums [splits, M, members * rank] (no columns without adapters)."""
    width = sum(s.shape[0] for s in scale)
    rank = lora_a[0].shape[0] if lora_a else 0
    out = x.new_empty((splits, x.shape[0], width),
                      dtype=torch.float32 if splits > 1 else x.dtype)
    return out, x.new_empty((splits, x.shape[0], len(lora_a) * rank), dtype=torch.float32)


def _unsupported(arch: str) -> str | None:
    if int(arch) < 80:
        return f"the GPU (sm_{arch}) has no bf16 tensor-core mma (needs sm_80 or newer)"
    return None


def unavailable_reason(device: torch.device) -> str | None:
    """Why the CUDA kernel cannot run on ``device`` (None: it can, its operator loaded on
    the device); builds it if needed."""
    return cuda_build.unavailable_reason(device, SOURCE, _unsupported)


@torch.compiler.assume_constant_result
def available(device: torch.device) -> bool:
    reason = unavailable_reason(device)
    if reason is not None and device.type == "cuda":
        _warn_once(reason)
    return reason is None


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("CUDA NVFP4 kernel unavailable, using the slower Triton kernel: %s", reason)


def launch_shape(m: int, widths: list[int], k: int, num_sms: int, rank: int = 0
                 ) -> tuple[int, int]:
    """(splits, k_warps) for members of these widths (and, with ``rank``, the in-launch
    LoRA shrink of that rank). Up to 8 rows, blocks split K (fp32 partials) until the GPU
    holds about as many warps as it runs at once: 4 warps per 16 rows are counted and the
    target is 32 warps per SM (at ~24 resident, two waves or more keep the last one short);
    within a block, 4 warps split K where there is one split (the strips alone fill the GPU,
    as a wide gate_up does, or K is short), else 2 (the narrower layers that need splits
    run faster so), and never more warps than quads of chunks (128 weights of K) to share.
    (More splits at M = 1 speed the kernel up and slow the LoRA expand, which adds the
    partials, by as much.) Above 8 rows the block's warps share x and so one K range
    (k_warps = 1): ``_shared_x_splits``."""
    quads = -(-k // 128)
    if m > SHARED_X_ABOVE:
        return _shared_x_splits(m, tuple(widths), quads, num_sms, rank), 1
    warps = -(-sum(widths) // 16) * 4
    splits = max(1, min(-(-32 * num_sms // warps), MAX_SPLITS, -(-quads // 8)))
    k_warps = 4 if splits == 1 else 2
    return splits, min(k_warps, 1 << max(0, (quads // splits).bit_length() - 1))


# Blocks an SM holds at once (the kernel's launch bounds, min_blocks in nvfp4_gemv.cu) by
# 8-row tiles, 1 to 4.
RESIDENT = (6, 5, 4, 4)
BLOCK_WARPS = 4  # kWarps in nvfp4_gemv.cu: a weight block's 16-row strips, a shrink's rows
BLOCK_COST = 4  # a block's fixed cost (its start, x's first stage, its stores) in quads
# What a split costs the expand that adds the partials up, in quads, fitted to the expand's
# time against its splits at 32 rows (an H200's decode-step profile).
SPLIT_COST = 0.75


# Cached: the search costs more than a launch, and a decode step outside a CUDA graph launches the
# kernel ~100 times with a handful of shapes.
@functools.cache
@torch.compiler.assume_constant_result  # torch.compile holds the choice
def _shared_x_splits(m: int, widths: tuple[int, ...], quads: int, num_sms: int, rank: int
                     ) -> int:
    """Above 8 rows a block is four 16-row strips of one member over one K range, and the
    launch takes as long as its waves of blocks, each as long as a block's quads of K plus
    a fixed cost: splits are chosen to minimise (waves x (quads a split + BLOCK_COST)),
    the fewest of equal cost. Waves count: a grid just past what the SMs hold runs a second
    wave as long as the first (kernels/DESIGN.md has the sweep). A shrink block's FMAs grow
    with the rows (a weight block's tensor-core work does not, below 16): above 16 rows its
    slice of K, not the waves, can set the time. Splits that leave a slice empty are never
    chosen, so every partial is written, and each split costs the consumer SPLIT_COST."""
    resident = RESIDENT[-(-m // 8) - 1] * num_sms
    blocks = sum(-(-n // (16 * BLOCK_WARPS)) for n in widths)
    if rank:
        blocks += len(widths) * -(-rank // BLOCK_WARPS)

    def cost(per_split: int) -> tuple[float, int]:
        splits = -(-quads // per_split)
        waves = -(-blocks * splits // resident)
        time = waves * (per_split + BLOCK_COST)
        if rank:
            time = max(time, per_split * m / 16 + BLOCK_COST)
        return time + SPLIT_COST * splits, splits

    return min(cost(q) for q in range(-(-quads // MAX_SPLITS), quads + 1))[1]


@dataclass(frozen=True)
class Weight:
    """One packed NVFP4 weight [n, K] of a launch (nvfp4_layout's pair-interleaved tiles)."""

    pairs: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    bias: torch.Tensor | None
    n: int


MAX_MEMBERS = 3  # weights one launch runs side by side (q/k/v)


def partials(x2: torch.Tensor, pairs: torch.Tensor, scale: torch.Tensor,
             global_scale: torch.Tensor, bias: torch.Tensor | None, n: int, k: int,
             splits: int | None = None, k_warps: int | None = None) -> torch.Tensor:
    """x2 [M, K] (M <= 32, CUDA, bf16/fp16, contiguous) -> [S, M, N] partial sums (fp32;
    with S = 1 the result in x's dtype). Shapes are checked by the caller (nvfp4_matmul)."""
    return grouped_partials(x2, [Weight(pairs, scale, global_scale, bias, n)], k, splits,
                            k_warps)


def grouped_partials(x2: torch.Tensor, weights: list[Weight], k: int,
                     splits: int | None = None, k_warps: int | None = None) -> torch.Tensor:
    """``partials`` of up to three weights that read the same x, in one launch: [S, M,
    sum of n], weight g in the columns after those of weights 0 .. g - 1."""
    return _launch(x2, weights, k, splits, k_warps, None)[0]


def grouped_partials_and_shrink(x2: torch.Tensor, weights: list[Weight], k: int,
                                lora_a: list[torch.Tensor], splits: int | None = None,
                                k_warps: int | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``grouped_partials`` and, in the same launch, the LoRA shrink of each weight's fp32
    adapter A_g [R, K]: (partials, xa) with xa [S, M, len(weights) * R] the shrink's fp32
    partial sums over the same S slices of K (member g in columns g*R .. (g+1)*R), whose
    sum over S is x2 @ A_g^T as PEFT computes it (x cast to fp32), to fp32 rounding."""
    if len(lora_a) != len(weights):
        raise QuantizationError(f"one adapter A per weight: {len(weights)} weights, "
                                f"{len(lora_a)} adapters")
    rank = lora_a[0].shape[0]
    if not shrinkable(lora_a, k, x2.device):
        got = ", ".join(f"{a.dtype} {tuple(a.shape)} on {a.device}" for a in lora_a)
        raise QuantizationError(f"the in-launch shrink takes contiguous, 16-byte aligned "
                                f"fp32 adapters [{rank}, {k}] (rank >= 1) on {x2.device}; "
                                f"got {got}")
    return _launch(x2, weights, k, splits, k_warps, lora_a)


def shrinkable(lora_a: list[torch.Tensor], k: int, on: torch.device) -> bool:
    """Whether the adapters A_g are what the in-launch shrink reads: fp32 [R, k] of one
    rank R >= 1, contiguous and 16-byte aligned, on the device ``on``."""
    rank = lora_a[0].shape[0]
    return rank >= 1 and all(
        a.dtype == torch.float32 and a.shape == (rank, k) and a.is_contiguous()
        and a.device == on and facts.aligned(a, 16) for a in lora_a)


def _launch(x2, weights, k, splits, k_warps, lora_a):
    m = x2.shape[0]
    if not 1 <= m <= MAX_M or x2.stride(-1) != 1 or x2.stride(0) != k:
        raise QuantizationError(f"the CUDA kernel takes 1 to {MAX_M} contiguous rows [M, K], "
                                f"got {tuple(x2.shape)} with strides {x2.stride()}")
    if not 1 <= len(weights) <= MAX_MEMBERS:
        raise QuantizationError(f"one launch runs 1 to {MAX_MEMBERS} weights, got "
                                f"{len(weights)}")
    if not (facts.aligned(x2, 16) and all(facts.aligned(w.pairs, 16) for w in weights)):
        raise QuantizationError("the CUDA kernel needs x and the packed weight 16-byte "
                                "aligned (a view that starts mid-vector)")
    if m > SHARED_X_ABOVE and k_warps not in (None, 1):
        raise QuantizationError(f"above {SHARED_X_ABOVE} rows the CUDA kernel's warps share "
                                f"x and one K range: k_warps must be 1, got {k_warps}")
    if not available(x2.device):
        raise QuantizationError(f"the CUDA kernel cannot run on {x2.device}: "
                                f"{unavailable_reason(x2.device)}")
    auto = launch_shape(m, [w.n for w in weights], k, facts.num_sms(x2.device),
                        0 if lora_a is None else lora_a[0].shape[0])
    out, xa = torch.ops.qerl.nvfp4_gemv(
        x2, [w.pairs for w in weights], [w.scale for w in weights],
        [w.global_scale for w in weights], [w.bias for w in weights], splits or auto[0],
        k_warps or auto[1], lora_a or [])
    return out, None if lora_a is None else xa
