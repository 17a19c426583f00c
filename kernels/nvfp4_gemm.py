"""The Hopper NVFP4 GEMM in CUDA C++ (nvfp4_gemm.cu): wgmma with the weight decoded into
its register operand, for the rows past the small-M kernel (nvfp4_gemv) on sm_90.

Built by cuda_build for sm_90a (wgmma is an architecture-specific feature), loaded with
ctypes, launched on torch's current stream. ``available()`` is False (with
``unavailable_reason()``) on other GPUs or without nvcc; the wrappers in nvfp4_matmul then
take the other paths.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from qerl.errors import QuantizationError
from qerl.kernels import cuda_build
from qerl.kernels import nvfp4_layout as layout

SOURCE = Path(__file__).with_name("nvfp4_gemm.cu")
ARCHS = cuda_build.SOURCES[SOURCE.name]  # device architecture -> what the kernel is built for
ROWS = 128  # weight rows a block multiplies
MAX_SPLITS = 16


@triton.jit
def _gemm_order_kernel(x_ptr, out_ptr, M, K, stride_xm, stride_om, BLOCK_M: tl.constexpr):
    """out[:, 128q + d] = x[:, 128q + src(d)] for one 128-column quad q and BLOCK_M rows
    (nvfp4_layout.gemm_order, zeros past K): one pass, both sides touching whole sectors."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    q = tl.program_id(1)
    d = tl.arange(0, 128)
    step = d // 16
    src = 32 * ((d // 2) % 4) + 16 * ((d // 8) % 2) + 4 * (step // 2) + 2 * (step % 2) + d % 2
    cols = q * 128 + src
    row_ok = rows[:, None] < M
    v = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :],
                mask=row_ok & (cols[None, :] < K), other=0.0)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + q * 128 + d[None, :], v,
             mask=row_ok)


def gemm_order(x2: torch.Tensor, quads: int) -> torch.Tensor:
    """nvfp4_layout.gemm_order in one kernel: x2 [M, K] -> [M, 128 * quads]."""
    m, k = x2.shape
    out = torch.empty((m, quads * layout.TILE_WEIGHTS), dtype=x2.dtype, device=x2.device)
    block_m = 16
    _gemm_order_kernel[(triton.cdiv(m, block_m), quads)](x2, out, m, k, x2.stride(0),
                                                         out.stride(0), BLOCK_M=block_m)
    return out


@functools.cache
def _library(arch: str) -> ctypes.CDLL:
    lib = cuda_build.library(SOURCE, arch)
    c = ctypes
    lib.qerl_nvfp4_gemm.argtypes = [
        c.c_int, c.c_void_p, c.c_longlong, c.c_void_p, c.c_longlong, c.c_void_p, c.c_longlong,
        c.c_void_p, c.c_void_p, c.c_void_p, c.c_int, c.c_longlong, c.c_longlong, c.c_int,
        c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_void_p]
    lib.qerl_nvfp4_gemm.restype = c.c_int
    return lib


@functools.cache
def _unavailable(device_arch: str) -> str | None:
    if device_arch not in ARCHS:
        return f"the GPU (sm_{device_arch}) has no wgmma (the kernel is for sm_90)"
    return cuda_build.build_failure(lambda: _library(ARCHS[device_arch]))


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can); builds it if needed."""
    return cuda_build.unavailable_reason(device, _unavailable)


def available(device: torch.device) -> bool:
    return unavailable_reason(device) is None


REQUIREMENT = (f"K a positive multiple of {layout.TILE_WEIGHTS}, the codes 16-byte and the "
               "scale rows 8-byte aligned")


def supports(k: int, scale: torch.Tensor, pairs: torch.Tensor) -> bool:
    """Whether the kernel reads this weight: its scale rows copy 8 bytes (a quad) at a
    time and its codes 16, so K is a positive multiple of 128 and scale rows and codes are
    aligned."""
    return (k > 0 and k % layout.TILE_WEIGHTS == 0 and scale.stride(1) == 1
            and scale.stride(0) % 8 == 0 and scale.data_ptr() % 8 == 0
            and pairs.data_ptr() % 16 == 0)


@dataclass(frozen=True)
class Launch:
    """A launch's shape: tokens a block multiplies (wgmma's N: 64 or 128) and splits of K."""

    token_tile: int
    splits: int


def launch_for(m: int, n: int, k: int, num_sms: int) -> Launch:
    """The launch shape, as sweeps of every shape on an H100 chose it (kernels/DESIGN.md).
    A weight of at least half a block per SM (gate_up, a large model's q/k/v) runs unsplit,
    64 tokens a block (two blocks an SM) unless 128-token blocks pad M no further and M >
    192. A narrower one (down, o, a small model's q/k/v) splits K so that the blocks fill
    each SM once, 128 tokens a block above 64 rows: fp32 partials cost more than a short
    last wave or a second block on an SM gains."""
    quads = k // layout.TILE_WEIGHTS
    tiles = -(-n // ROWS)
    if 2 * tiles >= num_sms:
        bm = 128 if m > 192 and -(-m // 128) * 128 <= -(-m // 64) * 64 else 64
        return Launch(bm, 1)
    bm = 64 if m <= 64 else 128
    splits = min(MAX_SPLITS, max(1, quads // 4), max(1, num_sms // (tiles * -(-m // bm))))
    return Launch(bm, nonempty_splits(splits, quads))


def nonempty_splits(splits: int, quads: int) -> int:
    """The splits the kernel runs: ceil(quads / splits) quads each, so none is empty."""
    return -(-quads // -(-quads // splits))


def partials(x2: torch.Tensor, pairs: torch.Tensor, scale: torch.Tensor,
             global_scale: torch.Tensor, bias: torch.Tensor | None, n: int, k: int,
             launch: Launch | None = None) -> torch.Tensor:
    """x2 [M, K] (CUDA, bf16/fp16, contiguous) -> [S, M, N] split-K partial sums (fp32;
    with S = 1 the result in x's dtype). Shapes are checked by the caller (nvfp4_matmul)."""
    m = x2.shape[0]
    quads = pairs.shape[1]
    if not supports(k, scale, pairs):
        raise QuantizationError(f"the Hopper NVFP4 GEMM takes {REQUIREMENT}; got K = {k}")
    xg = gemm_order(x2, quads)
    launch = launch or launch_for(m, n, k, torch.cuda.get_device_properties(x2.device)
                                  .multi_processor_count)
    splits = nonempty_splits(launch.splits, quads)
    out = torch.empty((splits, m, n), dtype=torch.float32 if splits > 1 else x2.dtype,
                      device=x2.device)
    arch = ARCHS[cuda_build.arch_of(x2.device)]
    _library(arch)
    lib = cuda_build.loaded(SOURCE, arch, cuda_build.index_of(x2.device))
    error = lib.qerl_nvfp4_gemm(
        int(x2.dtype == torch.bfloat16), xg.data_ptr(), xg.stride(0), pairs.data_ptr(),
        pairs.stride(0), scale.data_ptr(), scale.stride(0), global_scale.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), int(splits > 1),
        out.stride(0), out.stride(1), m, n, quads, splits, launch.token_tile,
        cuda_build.index_of(x2.device), torch.cuda.current_stream(x2.device).cuda_stream)
    if error:
        raise QuantizationError(f"the Hopper NVFP4 GEMM failed to launch: "
                                f"{cuda_build.error_text(SOURCE, arch, error)}")
    return out
