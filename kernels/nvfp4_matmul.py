"""Which NVFP4 kernel multiplies M rows by a weight, and the checks before it: y = x @
deq(W)^T and dx = dy @ deq(W) for NVFP4Linear, one launch for weights that read the same
rows (q/k/v, gate/up), and the torch reference.

Paths by M (rows of activations; kernels/DESIGN.md, "Paths by M"): on a GPU the forward
runs the CUDA kernel (nvfp4_gemv.cu) up to CUDA_MAX_M, where it builds; other forwards and
the input gradient run the fused Triton kernels up to FUSED_MAX_M; beyond,
``nvfp4_dequant_kernel`` decodes W once and cuBLAS multiplies. The fused kernels decode each
W tile once per M tile, so as M grows the decode, not the weight's bytes, sets their time;
where one decode plus cuBLAS wins is measured by ``qerl bench kernel-paths``
(results/bench/kernel_paths_*.csv).
"""

from __future__ import annotations

import itertools

import torch

from qerl.errors import QuantizationError
from qerl.formats import nvfp4
from qerl.kernels import crossovers
from qerl.kernels import device_facts as facts
from qerl.kernels import nvfp4_gemm as gemm
from qerl.kernels import nvfp4_gemv as gemv
from qerl.kernels import nvfp4_layout as layout
from qerl.kernels import nvfp4_triton as fused_kernels

# Which kernel multiplies M rows by the weight (the crossovers come from `qerl bench
# kernel-paths`): the CUDA kernel (nvfp4_gemv.cu, where it builds) up to CUDA_MAX_M rows, the
# fused Triton kernels up to FUSED_MAX_M; the Hopper GEMM (nvfp4_gemm.cu, sm_90) up to the
# rows the card's path sweep measured it winning at the weight's shape (crossovers.py);
# beyond, W decoded once and cuBLAS's GEMM. A caller (a benchmark timing one path against
# another) may name the path instead.
CUDA_MAX_M = 32
FUSED_MAX_M = 32
FORWARD_PATHS = ("cuda", "gemm", "triton", "dequant")
GRAD_INPUT_PATHS = ("triton", "dequant")


def _check(a: torch.Tensor, pairs, scale, global_scale, what: str) -> tuple[int, int]:
    """Validate the weight, then the activations ``a`` (``x``, last dim K, or ``dy``, last
    dim N); return the weight's (N, K)."""
    n, k = layout.check_layer(pairs, scale, global_scale)
    width = k if what == "x" else n
    if a.dtype not in fused_kernels.SCALE_FACTORS:
        raise QuantizationError(f"{what} must be bfloat16 or float16, got {a.dtype}")
    if a.shape[-1] != width:
        raise QuantizationError(f"{what} has last dim {a.shape[-1]}; the NVFP4 weight of "
                                f"shape {(n, k)} needs {width}")
    devices = {t.device for t in (a, pairs, scale, global_scale)}
    if len(devices) != 1:
        raise QuantizationError(f"{what} and the weight are on different devices: {devices}")
    if a.device.type != "cuda" and not facts.interpreting():
        raise QuantizationError(
            f"the Triton kernels need CUDA tensors (got {a.device}); on CPU use the torch "
            "reference (qerl.nn.NVFP4Linear picks it by itself)"
        )
    return n, k


def cuda_runs(x2: torch.Tensor) -> bool:
    """Whether the CUDA kernel can multiply the rows x2 [M, K] here: few enough rows, on a
    GPU where it builds."""
    return x2.shape[0] <= gemv.MAX_M and x2.is_cuda and gemv.available(x2.device)


def gemm_runs(x2: torch.Tensor, scale: torch.Tensor, pairs: torch.Tensor) -> bool:
    """Whether the Hopper GEMM can multiply the rows x2 by this weight here."""
    k = scale.shape[1] * nvfp4.GROUP_SIZE
    return x2.is_cuda and gemm.available(x2.device) and gemm.supports(k, scale, pairs)


def forward_path(x2: torch.Tensor, pairs: torch.Tensor, scale: torch.Tensor) -> str:
    """The forward path of the rows x2 [M, K] by this weight (see FORWARD_PATHS)."""
    m = x2.shape[0]
    if m <= CUDA_MAX_M and cuda_runs(x2):
        return "cuda"
    if m <= FUSED_MAX_M:
        return "triton"
    n, k = scale.shape[0], scale.shape[1] * nvfp4.GROUP_SIZE
    if gemm_runs(x2, scale, pairs) and m <= crossovers.gemm_max_m(facts.card(x2.device), n, k):
        return "gemm"
    return "dequant"


def grad_input_path(dy2: torch.Tensor) -> str:
    """The input gradient's path of the rows dy2 [M, N] (see GRAD_INPUT_PATHS)."""
    return "triton" if dy2.shape[0] <= FUSED_MAX_M else "dequant"


def _checked_path(path: str | None, auto, a2: torch.Tensor, scale: torch.Tensor,
                  pairs: torch.Tensor, paths: tuple[str, ...]) -> str:
    if path is None:
        return auto()
    if path not in paths:
        raise QuantizationError(f"unknown path {path!r}; choose one of {', '.join(paths)}")
    if path == "cuda" and not cuda_runs(a2):
        raise QuantizationError(f"the CUDA kernel runs 1 to {gemv.MAX_M} rows on a GPU where "
                                f"it builds; got {a2.shape[0]} rows on {a2.device}")
    if path == "gemm" and not gemm_runs(a2, scale, pairs):
        reason = (gemm.unavailable_reason(a2.device) or f"it takes {gemm.REQUIREMENT}; got "
                  f"K = {scale.shape[1] * nvfp4.GROUP_SIZE}")
        raise QuantizationError(f"the Hopper NVFP4 GEMM cannot run here: {reason}")
    return path


def _reduced(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return partials[0] if partials.shape[0] == 1 else partials.sum(0).to(dtype)


def nvfp4_linear(x: torch.Tensor, pairs: torch.Tensor, scale: torch.Tensor,
                 global_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 path: str | None = None) -> torch.Tensor:
    """y[..., N] = x[..., K] @ deq(W)^T + bias, fp32 accumulation, in x's dtype; W given
    pair-interleaved (nvfp4_layout.to_pairs). ``path`` (FORWARD_PATHS) forces a kernel;
    by default ``forward_path`` picks it by M."""
    n, k = _check(x, pairs, scale, global_scale, "x")
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        raise QuantizationError(f"bias must have shape ({n},) on {x.device}, got "
                                f"{tuple(bias.shape)} on {bias.device}")
    x2 = x.reshape(-1, k).contiguous()
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n))
    path = _checked_path(path, lambda: forward_path(x2, pairs, scale), x2, scale, pairs,
                         FORWARD_PATHS)
    if path in ("dequant", "gemm"):
        if path == "gemm":
            y = gemm.linear(x2, pairs, scale, global_scale, bias, k)
        else:  # compute-bound: decode W once, then the BF16 GEMM
            w = fused_kernels.dequantize(pairs, scale, global_scale, x.dtype)
            y = torch.nn.functional.linear(x2, w, bias)
        # Not even a same-shape view for 2-D x: a LoRA layer adds its adapter to it in place.
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)
    if path == "cuda":
        partials = gemv.partials(x2, pairs, scale, global_scale, bias, n, k)
    else:
        partials = fused_kernels.fused("fwd", x2, n, k, pairs, scale, global_scale, bias)
    return _reduced(partials, x.dtype).reshape(*x.shape[:-1], n)


def nvfp4_linear_grouped_partials(x2: torch.Tensor, weights: list[tuple]) -> list[torch.Tensor]:
    """x2 [M, K] with M <= FUSED_MAX_M by weights (pairs, scale, global_scale, bias) that
    read the same x2 -> each one's split-K partial sums [S, M, N] (fp32; with S = 1, the
    result itself in x's dtype), for a consumer that adds them up anyway and so saves the
    reduction's launch (summed over S and rounded to x's dtype, ``nvfp4_linear``'s
    result): in one launch where the CUDA kernel runs (up to three weights, the results
    column views of one buffer), else one launch each."""
    shapes = _check_group(x2, weights)
    k = x2.shape[1]
    if _one_launch(x2, weights):
        return _columns(gemv.grouped_partials(x2, _members(weights, shapes), k), shapes)
    if forward_path(x2, *weights[0][:2]) == "cuda":
        return [gemv.partials(x2, *w, n, k) for w, (n, _) in zip(weights, shapes, strict=True)]
    return [fused_kernels.fused("fwd", x2, n, k, *w)
            for w, (n, _) in zip(weights, shapes, strict=True)]


def nvfp4_linear_grouped_partials_and_shrink(
        x2: torch.Tensor, weights: list[tuple], lora_a: list[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """``nvfp4_linear_grouped_partials`` with each weight's LoRA shrink (fp32 A_g [R, K])
    in the same launch: (partials, xa [S, M, G * R], the shrink's partial sums over S),
    where the CUDA kernel runs the group in one launch; else None (shrink on your own)."""
    shapes = _check_group(x2, weights)
    if not _one_launch(x2, weights):
        return None
    out, xa = gemv.grouped_partials_and_shrink(x2, _members(weights, shapes), x2.shape[1],
                                               lora_a)
    return _columns(out, shapes), xa


def nvfp4_linear_grouped(x2: torch.Tensor, weights: list[tuple]) -> list[torch.Tensor] | None:
    """``nvfp4_linear`` of weights (pairs, scale, global_scale, bias) that read the same
    rows x2 [M, K] (q/k/v, gate/up), in one launch of the Hopper GEMM, where it runs them
    side by side (``nvfp4_gemm.groups``) and is the path for their joint shape: column
    views of one [M, sum of N]. None elsewhere (each weight then goes its own path)."""
    shapes = [_check(x2, *w[:3], "x") for w in weights]
    m, k = x2.shape
    ns = [n for n, _ in shapes]
    if not (m > FUSED_MAX_M and gemm.groups(ns) and x2.stride(-1) == 1
            and all(gemm_runs(x2, w[1], w[0]) for w in weights)
            and m <= crossovers.gemm_max_m(facts.card(x2.device), sum(ns), k)):
        return None
    return _columns(gemm.linear_group(x2, weights, k), shapes)


def _check_group(x2: torch.Tensor, weights: list[tuple]) -> list[tuple[int, int]]:
    shapes = [_check(x2, *w[:3], "x") for w in weights]
    if x2.dim() != 2 or not 1 <= x2.shape[0] <= FUSED_MAX_M or x2.stride(-1) != 1:
        raise QuantizationError(f"partial sums take 1 to {FUSED_MAX_M} contiguous rows "
                                f"[M, K], got {tuple(x2.shape)}")
    return shapes


def _one_launch(x2: torch.Tensor, weights: list[tuple]) -> bool:
    return len(weights) <= gemv.MAX_MEMBERS and forward_path(x2, *weights[0][:2]) == "cuda"


def _members(weights: list[tuple], shapes: list[tuple[int, int]]) -> list[gemv.Weight]:
    return [gemv.Weight(*w, n) for w, (n, _) in zip(weights, shapes, strict=True)]


def _columns(out: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each weight's columns of one launch's [S, M, sum of n] output."""
    starts = [0, *itertools.accumulate(n for n, _ in shapes)]
    return [out[..., a:b] for a, b in itertools.pairwise(starts)]


def nvfp4_linear_grad_input(dy: torch.Tensor, pairs: torch.Tensor, scale: torch.Tensor,
                            global_scale: torch.Tensor, path: str | None = None
                            ) -> torch.Tensor:
    """dx[..., K] = dy[..., N] @ deq(W): the input gradient of a frozen NVFP4 Linear.
    ``path`` (GRAD_INPUT_PATHS) forces a kernel; by default ``grad_input_path`` picks it."""
    n, k = _check(dy, pairs, scale, global_scale, "dy")
    dy2 = dy.reshape(-1, n).contiguous()
    if dy2.shape[0] == 0:
        return dy.new_empty((*dy.shape[:-1], k))
    if _checked_path(path, lambda: grad_input_path(dy2), dy2, scale, pairs,
                     GRAD_INPUT_PATHS) == "dequant":
        w = fused_kernels.dequantize(pairs, scale, global_scale, dy.dtype)
        return (dy2 @ w).reshape(*dy.shape[:-1], k)
    return _reduced(fused_kernels.fused("bwd", dy2, n, k, pairs, scale, global_scale),
                    dy.dtype).reshape(*dy.shape[:-1], k)


def _reference_weight(pairs, scale, global_scale, dtype):
    n, k = layout.check_layer(pairs, scale, global_scale)
    packed = layout.from_pairs(pairs, n, k)
    return nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scale, global_scale), dtype)


def reference_linear(x: torch.Tensor, pairs: torch.Tensor, scale: torch.Tensor,
                     global_scale: torch.Tensor, bias: torch.Tensor | None = None):
    """The torch reference (any device): dequantize to x's dtype, then matmul."""
    w = _reference_weight(pairs, scale, global_scale, x.dtype)
    return torch.nn.functional.linear(x, w, bias)
