"""Fused NVFP4 dequantize + matmul (Triton): y = x @ deq(W)^T and dx = dy @ deq(W).

The packed weight is read once and decoded in registers by bit placement: a code's three
magnitude bits shifted into an fp16's exponent/mantissa (sign to bit 15) are exactly
E2M1 * 2^-14, so ``fp16 * (scale * 2^14 / global_scale)`` is the dequantized weight, bit for
bit what ``qerl.formats.nvfp4.dequantize`` computes in fp32 before rounding.

Triton's CPU interpreter (TRITON_INTERPRET=1, how CI runs these kernels) computes bf16
tl.dot wrongly, so there ``DOT_F32`` feeds the dot fp32 operands instead; on a GPU the
dot takes the activations' own dtype.

The fused kernels serve small M (decode), where reading the weight is the whole cost: an
FMA GEMV for M <= GEMV_MAX_M and a tl.dot kernel (M padded to 16) up to SKINNY_MAX_M. With
``SPLIT_K > 1`` programs split the reduction and write fp32 partials ([SPLIT_K, M, cols],
summed by the caller) so that the read is spread over the whole GPU. Beyond, the weight is
decoded once by ``nvfp4_dequant_kernel`` and the product runs on cuBLAS: a fused tiled
kernel measured 4-5x slower than cuBLAS at M >= 512 on an H200 (decoding each W tile once
per M tile), and the tl.dot kernel loses to dequantize + cuBLAS from M = 32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qerl.errors import QuantizationError
from qerl.formats import nvfp4

# E2M1 magnitude m placed as fp16 bits is m * 2^-14 (code 1 lands on a subnormal).
E2M1_AS_FP16_UNSCALE = tl.constexpr(16384.0)


@triton.jit
def _e2m1_as_fp16(code):
    """E2M1 codes (u8) -> fp16 equal to E2M1 * 2^-14: magnitude bits into exponent/mantissa,
    sign to bit 15."""
    bits = ((code & 7).to(tl.int16) << 9) | ((code & 8).to(tl.int16) << 12)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _group_multiplier(scale, global_scale):
    """fp8 block scales -> fp32 multipliers of the fp16-placed codes: scale / global_scale,
    correctly rounded as the reference divides, times 2^14 (exact)."""
    return tl.math.div_rn(scale.to(tl.float32), global_scale) * E2M1_AS_FP16_UNSCALE


@triton.jit
def _dequant_halves(packed, scale, global_scale, ROWS: tl.constexpr, HALF: tl.constexpr):
    """packed u8 [ROWS, HALF] + scale fp8 [ROWS, HALF/8] -> fp32 (even, odd) [ROWS, HALF]:
    the weights at k = 2j (low nibbles) and k = 2j + 1 (high nibbles)."""
    s = _group_multiplier(scale, global_scale)[:, :, None]  # a group of 16 weights is 8 bytes
    even = tl.reshape(_e2m1_as_fp16(packed & 0xF), (ROWS, HALF // 8, 8)).to(tl.float32) * s
    odd = tl.reshape(_e2m1_as_fp16(packed >> 4), (ROWS, HALF // 8, 8)).to(tl.float32) * s
    return tl.reshape(even, (ROWS, HALF)), tl.reshape(odd, (ROWS, HALF))


@triton.jit
def _dequant_tile(packed, scale, global_scale, ROWS: tl.constexpr, COLS: tl.constexpr):
    """packed u8 [ROWS, COLS/2] + scale fp8 [ROWS, COLS/16] -> fp32 [ROWS, COLS]."""
    even, odd = _dequant_halves(packed, scale, global_scale, ROWS, COLS // 2)
    # join puts element 2j before 2j + 1.
    return tl.reshape(tl.join(even, odd), (ROWS, COLS))


@triton.jit
def _load_weight_tile(packed_ptr, scale_ptr, rows, c, N, K, stride_pn, stride_sn,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Rows ``rows`` of W, columns [c * BLOCK_K, (c + 1) * BLOCK_K): packed u8
    [R, BLOCK_K/2] and scales [R, BLOCK_K/16]. The row strides come in as arguments, so
    that Triton sees their divisibility and issues 16-byte loads; EVEN_K (K % BLOCK_K == 0)
    drops the column mask, which would otherwise split the loads into single bytes."""
    b = c * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    g = c * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    row_ok = rows[:, None] < N
    if EVEN_K:
        p_mask = row_ok
        s_mask = row_ok
    else:
        p_mask = row_ok & (b[None, :] < K // 2)
        s_mask = row_ok & (g[None, :] < K // 16)
    p = tl.load(packed_ptr + rows[:, None] * stride_pn + b[None, :], mask=p_mask, other=0)
    sc = tl.load(scale_ptr + rows[:, None] * stride_sn + g[None, :], mask=s_mask, other=0.0)
    return p, sc


@triton.jit
def _tile_ids(M, cols, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_c) in grouped order, so that neighbouring programs share weight tiles."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_c = tl.cdiv(cols, BLOCK_C)
    group = GROUP_M * num_c
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + (pid % group) % size_m, (pid % group) // size_m


@triton.jit
def _reduction_range(red, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr):
    chunks = tl.cdiv(red, BLOCK_R)
    per_split = tl.cdiv(chunks, SPLIT_K)
    start = tl.program_id(1) * per_split
    return start, min(chunks, start + per_split)


@triton.jit
def _store(out_ptr, acc, offs_m, offs_c, M, cols, stride_os, stride_om, stride_oc):
    out = (out_ptr + tl.program_id(1) * stride_os + offs_m[:, None] * stride_om
           + offs_c[None, :] * stride_oc)
    mask = (offs_m[:, None] < M) & (offs_c[None, :] < cols)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def nvfp4_fwd_kernel(
    x_ptr, packed_ptr, scale_ptr, global_scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_pn, stride_sn, stride_os, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[M, N] = x[M, K] @ deq(W[N, K])^T (+ bias): W tiles are [BLOCK_N, BLOCK_K]."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    global_scale = tl.load(global_scale_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start, stop = _reduction_range(K, BLOCK_K, SPLIT_K)
    for c in range(start, stop):
        k = c * BLOCK_K + offs_k
        x_mask = offs_m[:, None] < M
        if not EVEN_K:
            x_mask = x_mask & (k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        p, sc = _load_weight_tile(packed_ptr, scale_ptr, offs_n, c, N, K, stride_pn, stride_sn,
                                  BLOCK_K, EVEN_K)
        # Interleaving the decoded weights (tl.join) measured faster than splitting x into
        # its even/odd columns, whose stride-2 loads cost 2-4x at M = 16-64 (H200).
        w = _dequant_tile(p, sc, global_scale, BLOCK_N, BLOCK_K)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w))
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:  # noqa: SIM102 (a constexpr test: Triton compiles the branch away)
        if tl.program_id(1) == 0:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    _store(out_ptr, acc, offs_m, offs_n, M, N, stride_os, stride_om, stride_on)


@triton.jit
def nvfp4_bwd_kernel(
    dy_ptr, packed_ptr, scale_ptr, global_scale_ptr, out_ptr,
    M, N, K,
    stride_dym, stride_pn, stride_sn, stride_os, stride_om, stride_ok,
    SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[M, K] = dy[M, N] @ deq(W[N, K]): W tiles are [BLOCK_N, BLOCK_K], reduced over N."""
    pid_m, pid_k = _tile_ids(M, K, BLOCK_M, BLOCK_K, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    global_scale = tl.load(global_scale_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    start, stop = _reduction_range(N, BLOCK_N, SPLIT_K)
    for c in range(start, stop):
        n = c * BLOCK_N + offs_n
        dy = tl.load(dy_ptr + offs_m[:, None] * stride_dym + n[None, :],
                     mask=(offs_m[:, None] < M) & (n[None, :] < N), other=0.0)
        p, sc = _load_weight_tile(packed_ptr, scale_ptr, n, pid_k, N, K, stride_pn, stride_sn,
                                  BLOCK_K, EVEN_K)
        w = _dequant_tile(p, sc, global_scale, BLOCK_N, BLOCK_K)
        if DOT_F32:
            acc += tl.dot(dy.to(tl.float32), w)
        else:
            acc += tl.dot(dy, w.to(dy.dtype))
    _store(out_ptr, acc, offs_m, offs_k, M, K, stride_os, stride_om, stride_ok)


@triton.jit
def nvfp4_gemv_kernel(
    x_ptr, packed_ptr, scale_ptr, global_scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_pn, stride_sn, stride_os, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[M, N] = x[M, K] @ deq(W[N, K])^T (+ bias) for M <= BLOCK_M <= 8, on FMAs: x is
    split into its even and odd columns (matching the low and high nibbles, so the decoded
    weights are never interleaved) and each group scale multiplies one 16-weight partial
    sum instead of every weight."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    global_scale = tl.load(global_scale_ptr)
    # Scaled group sums accumulate per (row, n, group) and are reduced across threads once,
    # after the loop.
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
    start, stop = _reduction_range(K, BLOCK_K, SPLIT_K)
    for c in range(start, stop):
        p, sc = _load_weight_tile(packed_ptr, scale_ptr, offs_n, c, N, K, stride_pn, stride_sn,
                                  BLOCK_K, EVEN_K)
        k = c * BLOCK_K + offs_k
        s = _group_multiplier(sc, global_scale)
        w_even = _e2m1_as_fp16(p & 0xF).to(tl.float32)  # [BLOCK_N, BLOCK_K/2]
        w_odd = _e2m1_as_fp16(p >> 4).to(tl.float32)
        for i in tl.static_range(BLOCK_M):
            x_mask = k * 0 + i < M
            if not EVEN_K:
                x_mask = x_mask & (k < K)
            x = tl.load(x_ptr + i * stride_xm + k, mask=x_mask, other=0.0).to(tl.float32)
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_K // 2, 2)))
            prod = w_even * x_even[None, :] + w_odd * x_odd[None, :]
            groups = tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // 16, 8)), axis=2)
            acc += tl.where(rows[:, None, None] == i, (groups * s)[None, :, :], 0.0)
    out = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:  # noqa: SIM102 (a constexpr test: Triton compiles the branch away)
        if tl.program_id(1) == 0:
            out += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    _store(out_ptr, out, rows, offs_n, M, N, stride_os, stride_om, stride_on)


@triton.jit
def nvfp4_dequant_kernel(packed_ptr, scale_ptr, global_scale_ptr, out_ptr, N, K,
                         stride_pn, stride_sn, stride_on,
                         EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[N, K] = deq(W) in out's dtype: the large-M path's one pass over the weight."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    p, sc = _load_weight_tile(packed_ptr, scale_ptr, offs_n, tl.program_id(1), N, K,
                              stride_pn, stride_sn, BLOCK_K, EVEN_K)
    w = _dequant_tile(p, sc, tl.load(global_scale_ptr), BLOCK_N, BLOCK_K)
    mask = offs_n[:, None] < N
    if not EVEN_K:
        mask = mask & (offs_k[None, :] < K)
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=mask)


# ---- launch wrappers: check inputs, pick the variant by M --------------------------------

# Paths by M (rows of activations), chosen by an H200 sweep (kernels/NOTES.md): the FMA
# GEMV up to GEMV_MAX_M, the fused tl.dot kernel up to SKINNY_MAX_M, one dequantize kernel
# then cuBLAS beyond. GEMV tiles as (BLOCK_N, BLOCK_K, num_warps, num_stages): wide layers
# (gate_up, qkv) want more rows per program, tall ones (down, N < 8192) longer K chunks.
# Module-level so that a benchmark sweep can try others.
GEMV_MAX_M = 2
SKINNY_MAX_M = 16
GEMV_TILE_WIDE = (16, 512, 4, 3)
GEMV_TILE_TALL = (8, 1024, 4, 3)
WIDE_N = 8192


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check(a: torch.Tensor, packed, scale, global_scale, width: int, what: str) -> None:
    nvfp4.check_packed(packed, scale, global_scale)
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise QuantizationError(f"{what} must be bfloat16 or float16, got {a.dtype}")
    if a.shape[-1] != width:
        raise QuantizationError(f"{what} has last dim {a.shape[-1]}; the NVFP4 weight of "
                                f"shape {red_dims(packed)} needs {width}")
    devices = {t.device for t in (a, packed, scale, global_scale)}
    if len(devices) != 1:
        raise QuantizationError(f"{what} and the weight are on different devices: {devices}")
    if a.device.type != "cuda" and not interpreting():
        raise QuantizationError(
            f"the Triton kernels need CUDA tensors (got {a.device}); on CPU use the torch "
            "reference (qerl.nn.NVFP4Linear picks it by itself)"
        )


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of one launch. ``block_c``: output columns per program (N forward, K
    backward); ``block_r``: reduction chunk (K forward, N backward)."""

    block_m: int
    block_c: int
    block_r: int
    split_k: int
    num_warps: int
    num_stages: int

    def meta(self, op: str) -> dict:
        cols, red = ("BLOCK_K", "BLOCK_N") if op == "bwd" else ("BLOCK_N", "BLOCK_K")
        meta = {"BLOCK_M": self.block_m, cols: self.block_c, red: self.block_r,
                "SPLIT_K": self.split_k, "num_warps": self.num_warps,
                "num_stages": self.num_stages}
        return meta if op == "gemv" else {**meta, "GROUP_M": 8}


def launch_config(op: str, m: int, cols: int, red: int, num_sms: int) -> LaunchConfig:
    """Tiles of a fused kernel (op: gemv | fwd | bwd) with output M x cols reduced over
    ``red``: split K until the grid covers the GPU twice."""
    if op == "gemv":
        block_m = triton.next_power_of_2(m)
        tile = GEMV_TILE_WIDE if cols >= WIDE_N else GEMV_TILE_TALL
        block_c, block_r, warps, stages = tile
    else:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_c, block_r = (64, 256) if op == "fwd" else (128, 128)
        warps, stages = 4, 3 if block_m == 64 else 4
    chunks = triton.cdiv(red, block_r)
    split = max(1, min(chunks, triton.cdiv(2 * num_sms, triton.cdiv(cols, block_c))))
    return LaunchConfig(block_m, block_c, block_r, split, warps, stages)


def red_dims(packed: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a packed weight."""
    return packed.shape[0], packed.shape[1] * 2


def _run(op: str, a2, packed, scale, global_scale, bias=None):
    n, k = red_dims(packed)
    m = a2.shape[0]
    cols, red = (k, n) if op == "bwd" else (n, k)
    cfg = launch_config(op, m, cols, red, _num_sms(a2.device))
    out_dtype = torch.float32 if cfg.split_k > 1 else a2.dtype
    out = torch.empty((cfg.split_k, m, cols), dtype=out_dtype, device=a2.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(cols, cfg.block_c), cfg.split_k)
    dot_f32 = {"DOT_F32": interpreting() and a2.dtype == torch.bfloat16}
    common = cfg.meta(op) if op == "gemv" else {**dot_f32, **cfg.meta(op)}
    strides = (a2.stride(0), packed.stride(0), scale.stride(0),
               out.stride(0), out.stride(1), out.stride(2))
    common["EVEN_K"] = (k % cfg.block_c if op == "bwd" else k % cfg.block_r) == 0
    if op == "gemv":  # one program covers all M rows: block_m >= m
        nvfp4_gemv_kernel[grid](a2, packed, scale, global_scale,
                                bias if bias is not None else global_scale, out, m, n, k,
                                *strides, HAS_BIAS=bias is not None, **common)
    elif op == "fwd":
        nvfp4_fwd_kernel[grid](a2, packed, scale, global_scale,
                               bias if bias is not None else global_scale, out, m, n, k,
                               *strides, HAS_BIAS=bias is not None, **common)
    else:
        nvfp4_bwd_kernel[grid](a2, packed, scale, global_scale, out, m, n, k, *strides,
                               **common)
    return out[0] if cfg.split_k == 1 else out.sum(0).to(a2.dtype)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """deq(W) [N, K] in ``dtype``, in one kernel (bit-identical to nvfp4.dequantize)."""
    n, k = red_dims(packed)
    out = torch.empty((n, k), dtype=dtype, device=packed.device)
    block_n, block_k = 32, 256
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    nvfp4_dequant_kernel[grid](packed, scale, global_scale, out, n, k, packed.stride(0),
                               scale.stride(0), out.stride(0), EVEN_K=k % block_k == 0,
                               BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 global_scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[..., N] = x[..., K] @ deq(W)^T + bias, fp32 accumulation, in x's dtype."""
    n, k = red_dims(packed)
    _check(x, packed, scale, global_scale, k, "x")
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        raise QuantizationError(f"bias must have shape ({n},) on {x.device}, got "
                                f"{tuple(bias.shape)} on {bias.device}")
    x2 = x.reshape(-1, k).contiguous()
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n))
    m = x2.shape[0]
    if m > SKINNY_MAX_M:  # compute-bound: decode W once, then the BF16 GEMM
        w = dequantize(packed, scale, global_scale, x.dtype)
        return torch.nn.functional.linear(x2, w, bias).reshape(*x.shape[:-1], n)
    op = "gemv" if m <= GEMV_MAX_M else "fwd"
    return _run(op, x2, packed, scale, global_scale, bias).reshape(*x.shape[:-1], n)


def nvfp4_linear_grad_input(dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                            global_scale: torch.Tensor) -> torch.Tensor:
    """dx[..., K] = dy[..., N] @ deq(W): the input gradient of a frozen NVFP4 Linear."""
    n, k = red_dims(packed)
    _check(dy, packed, scale, global_scale, n, "dy")
    dy2 = dy.reshape(-1, n).contiguous()
    if dy2.shape[0] == 0:
        return dy.new_empty((*dy.shape[:-1], k))
    if dy2.shape[0] > SKINNY_MAX_M:
        w = dequantize(packed, scale, global_scale, dy.dtype)
        return (dy2 @ w).reshape(*dy.shape[:-1], k)
    return _run("bwd", dy2, packed, scale, global_scale).reshape(*dy.shape[:-1], k)


def reference_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                     global_scale: torch.Tensor, bias: torch.Tensor | None = None):
    """The torch reference (any device): dequantize to x's dtype, then matmul."""
    w = nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scale, global_scale), x.dtype)
    return torch.nn.functional.linear(x, w, bias)


def reference_grad_input(dy, packed, scale, global_scale):
    w = nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scale, global_scale), dy.dtype)
    return dy @ w
