"""RMSNorm in one kernel, optionally after the residual add that precedes it.

Hugging Face's Qwen2/Llama RMSNorm is seven elementwise and reduction kernels per call; in
a decode step, where every tensor is a few rows, each costs its launch, not its bytes. The
rounding follows theirs exactly: the residual sum and the normalized rows are rounded to
the input dtype, then multiplied by the weight (bf16, or fp32 while AQN perturbs it) and
rounded once more. Only the sum of squares may differ in its last bits (reduction order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels.rounding import round_as


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, N, eps,
                    stride_x, stride_r, stride_o, stride_s,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = round_as(x.to(tl.float32) + r.to(tl.float32), x.dtype).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    normed = round_as(xf * tl.math.rsqrt(var + eps), x.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(h) * weight, h) with h = x + residual (or x), both in x's dtype, any leading
    shape."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"RMSNorm weight has shape {tuple(weight.shape)}, rows have {n}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    x2 = x.reshape(-1, n)
    r2 = residual.reshape(-1, n) if residual is not None else x2
    out = torch.empty_like(x2)
    total = torch.empty_like(x2) if residual is not None else x2
    if x2.shape[0]:
        rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, total, n, eps, x2.stride(0), r2.stride(0), out.stride(0),
            total.stride(0), HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n),
            num_warps=4 if n <= 4096 else 8)
    return out.view(x.shape), total.view(x.shape)


def reference_rms_norm(x, weight, eps, residual=None):
    """The same, as Hugging Face computes it."""
    h = x if residual is None else x + residual
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype), h
