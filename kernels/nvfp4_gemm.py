"""The Hopper NVFP4 GEMM in CUDA C++ (nvfp4_gemm.cu): wgmma with the weight decoded into
its register operand, for the rows past the small-M kernel (nvfp4_gemv) on sm_90.

The PyTorch operator ``qerl::nvfp4_gemm``: its schema and fake implementation are
defined here; the library cuda_build makes for sm_90a (wgmma is an architecture-specific
feature) registers its CUDA implementation when it is loaded. It launches on torch's
current stream. ``available()`` is False (with
``unavailable_reason()``) on other GPUs or without nvcc; the wrappers in nvfp4_matmul then
take the other paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from qerl.errors import QuantizationError
from qerl.kernels import cuda_build
from qerl.kernels import device_facts as facts
from qerl.kernels import nvfp4_layout as layout

SOURCE = Path(__file__).with_name("nvfp4_gemm.cu")
ARCHS = cuda_build.SOURCES[SOURCE.name]  # device architecture -> what the kernel is built for
ROWS = 128  # weight rows a block multiplies
# The fewest (tile, quad) units a block takes: below, a block's pipeline fill and its
# partial cost more than the SM it fills gains.
MIN_UNITS = 8


@triton.jit
def _gemm_tiles_kernel(x_ptr, out_ptr, ready_ptr, M, K, ROWS, stride_xm, READY,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """nvfp4_layout.gemm_tiles for one 128-column quad q and BLOCK_M of its ROWS rows (zeros
    past M and K): one pass, both sides touching whole sectors. The first program also
    zeroes the GEMM's READY flags, which would take a launch of their own."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    q = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    tl.store(ready_ptr + r, tl.zeros([BLOCK_R], tl.int32),
             mask=r < tl.where(tl.program_id(0) + q == 0, READY, 0))
    # Output column p (half p // 64, chunk p // 8 % 8) of row r holds gemm_order's column
    # d of that half, chunk p // 8 % 8 ^ r % 8: rows are loaded and stored whole, and
    # permuted in between.
    p = tl.arange(0, 128)
    v = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + q * 128 + p[None, :],
                mask=(rows[:, None] < M) & (q * 128 + p[None, :] < K), other=0.0)
    half = p // 64
    d = half[None, :] * 64 + (((p // 8) % 8)[None, :] ^ (rows[:, None] % 8)) * 8 + p[None, :] % 8
    step = d // 16
    src = 32 * ((d // 2) % 4) + 16 * ((d // 8) % 2) + 4 * (step // 2) + 2 * (step % 2) + d % 2
    v = tl.gather(v, src, axis=1)
    at = ((q * 2 + half[None, :]).to(tl.int64) * ROWS + rows[:, None]) * 64 + p[None, :] % 64
    tl.store(out_ptr + at, v, mask=rows[:, None] < ROWS)


def gemm_tiles(x2: torch.Tensor, quads: int, rows: int, ready: torch.Tensor) -> torch.Tensor:
    """nvfp4_layout.gemm_tiles in one kernel: x2 [M, K] -> [quads, 2, rows, 64]; zeroes the
    int32 tensor ``ready`` on the way. Traced by torch.compile as the operator
    ``qerl::gemm_tiles``; eagerly Triton's own launch, without an operator's dispatch,
    which would add host time to every prefill GEMM."""
    if torch.compiler.is_compiling():
        return torch.ops.qerl.gemm_tiles(x2, quads, rows, ready)
    return _tiles(_gemm_tiles_kernel, x2, quads, rows, ready)


def _tiles(kernel, x2: torch.Tensor, quads: int, rows: int, ready: torch.Tensor
           ) -> torch.Tensor:
    m, k = x2.shape
    out = torch.empty((quads, 2, rows, layout.GEMM_TILE_COLUMNS), dtype=x2.dtype,
                      device=x2.device)
    block_m = 16
    kernel[(triton.cdiv(rows, block_m), quads)](
        x2, out, ready, m, k, rows, x2.stride(0), ready.numel(),
        BLOCK_M=block_m, BLOCK_R=triton.next_power_of_2(max(ready.numel(), 1)))
    return out


@torch.library.triton_op("qerl::gemm_tiles", mutates_args={"ready"})
def _gemm_tiles_op(x2: torch.Tensor, quads: int, rows: int, ready: torch.Tensor
                   ) -> torch.Tensor:
    # The launch wrapped, so that torch.compile (and Inductor) see the Triton kernel.
    return _tiles(torch.library.wrap_triton(_gemm_tiles_kernel), x2, quads, rows, ready)


torch.library.define(
    "qerl::nvfp4_gemm",
    "(Tensor x, Tensor(a!) ready, Tensor[] pairs, Tensor[] scale, Tensor[] global_scale, "
    "Tensor?[] bias, int m, int token_tile, int blocks) -> Tensor")


@torch.library.register_fake("qerl::nvfp4_gemm")
def _fake(x, ready, pairs, scale, global_scale, bias, m, token_tile, blocks):
    """What the CUDA implementation returns (nvfp4_gemm.cu): [m, sum of N] in x's dtype,
    x being the rows in gemm order (``gemm_tiles``); it sets the flags ``ready``."""
    return x.new_empty((m, sum(s.shape[0] for s in scale)))


def _unsupported(arch: str) -> str | None:
    if arch not in ARCHS:
        return f"the GPU (sm_{arch}) has no wgmma (the kernel is for sm_90)"
    return None


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can, its operator loaded on the
    device); builds it if needed."""
    return cuda_build.unavailable_reason(device, SOURCE, _unsupported)


@torch.compiler.assume_constant_result
def available(device: torch.device) -> bool:
    return unavailable_reason(device) is None


REQUIREMENT = (f"K a positive multiple of {layout.TILE_WEIGHTS}, the codes 16-byte and the "
               "scale rows 8-byte aligned")


def supports(k: int, scale: torch.Tensor, pairs: torch.Tensor) -> bool:
    """Whether the kernel reads this weight: its scale rows copy 8 bytes (a quad) at a
    time and its codes 16, so K is a positive multiple of 128 and scale rows and codes are
    aligned."""
    return (k > 0 and k % layout.TILE_WEIGHTS == 0 and scale.stride(1) == 1
            and scale.stride(0) % 8 == 0 and facts.aligned(scale, 8)
            and facts.aligned(pairs, 16))


@dataclass(frozen=True)
class Launch:
    """A launch's shape: tokens a block multiplies (wgmma's N: one of TOKEN_TILES) and
    blocks, each an equal run of the (tile, quad) units (stream-K)."""

    token_tile: int
    blocks: int


def units(m: int, n: int, k: int, token_tile: int) -> int:
    """The (tile, quad) units of an [m, k] x [n, k]^T product: tiles of 128 weight rows by
    ``token_tile`` tokens, quads of 128 columns."""
    return -(-m // token_tile) * -(-n // ROWS) * (k // layout.TILE_WEIGHTS)


TOKEN_TILES = (64, 128, 192, 256)  # the kernel's instances (wgmma N)
# A pass over the weight costs about as much as this many tokens more than its tile: each
# pass loads and decodes the whole weight. Fitted to `qerl bench token-tiles` (the big
# layers, where the choice matters).
PASS_TOKENS = 72


@torch.compiler.assume_constant_result  # torch.compile holds the choice
def token_tile(m: int) -> int:
    """The token tile for m rows (kernels/DESIGN.md): 64 up to 64 rows;
    above, of 128, 192 and 256 the one whose passes over the weight cost least, a pass
    costing its tile plus PASS_TOKENS (ties: the wider): 192 for 129-192 rows, 256 for
    193-256, two of 192 for 257-384."""
    if m <= TOKEN_TILES[0]:
        return TOKEN_TILES[0]
    return min(TOKEN_TILES[1:], key=lambda bm: (-(-m // bm) * (bm + PASS_TOKENS), -bm))


def launch_for(m: int, n: int, k: int, num_sms: int, bm: int | None = None) -> Launch:
    """The launch shape (kernels/DESIGN.md): ``bm`` tokens a block (default
    ``token_tile(m)``); a block an SM, as many blocks as there are SMs but no fewer than
    MIN_UNITS units each."""
    bm = bm or token_tile(m)
    work = units(m, n, k, bm)
    return Launch(bm, max(1, min(num_sms, -(-work // MIN_UNITS))))


MAX_MEMBERS = 3  # weights one launch multiplies side by side


def groups(ns: list[int]) -> bool:
    """Whether weights of these widths go through one launch, side by side: at most three,
    every one but the last a whole number of 128-row tiles (a tile reads one weight)."""
    return 1 <= len(ns) <= MAX_MEMBERS and all(n % ROWS == 0 for n in ns[:-1])


def linear(x2: torch.Tensor, pairs: torch.Tensor, scale: torch.Tensor,
           global_scale: torch.Tensor, bias: torch.Tensor | None, k: int,
           launch: Launch | None = None) -> torch.Tensor:
    """x2 [M, K] (CUDA, bf16/fp16, contiguous) -> x2 @ deq(W)^T + bias [M, N] in x's dtype,
    N the scale's rows. Shapes are checked by the caller (nvfp4_matmul)."""
    return linear_group(x2, [(pairs, scale, global_scale, bias)], k, launch)


def linear_group(x2: torch.Tensor, weights: list[tuple], k: int,
                 launch: Launch | None = None) -> torch.Tensor:
    """``linear`` of weights (pairs, scale, global_scale, bias) that read the same x2, in
    one launch (``groups`` of their widths): [M, sum N], their outputs side by side."""
    m = x2.shape[0]
    ns = [w[1].shape[0] for w in weights]
    n = sum(ns)
    quads = weights[0][0].shape[1]
    if not groups(ns):
        raise QuantizationError(f"one GEMM launch takes 1 to {MAX_MEMBERS} weights, each but "
                                f"the last a multiple of {ROWS} rows; got {ns}")
    for pairs, scale, *_ in weights:
        if not supports(k, scale, pairs):
            raise QuantizationError(f"the Hopper NVFP4 GEMM takes {REQUIREMENT}; got K = {k}")
    launch = launch or launch_for(m, n, k, facts.num_sms(x2.device))
    work = units(m, n, k, launch.token_tile)
    if not 1 <= launch.blocks <= work:
        raise QuantizationError(f"{launch} has blocks outside 1..{work} (the units)")
    if not available(x2.device):
        raise QuantizationError(f"the Hopper NVFP4 GEMM cannot run on {x2.device}: "
                                f"{unavailable_reason(x2.device)}")
    # A block's first piece and its last each have a flag (nvfp4_gemm.cu).
    ready = torch.empty(2 * launch.blocks, dtype=torch.int32, device=x2.device)
    xg = gemm_tiles(x2, quads, -(-m // launch.token_tile) * launch.token_tile, ready)
    return torch.ops.qerl.nvfp4_gemm(
        xg, ready, [w[0] for w in weights], [w[1] for w in weights], [w[2] for w in weights],
        [w[3] for w in weights], m, launch.token_tile, launch.blocks)
