"""Unmerged LoRA for a decode step in two kernels per group of projections that share an
input (q/k/v, gate/up), instead of PEFT's six per projection (cast, two GEMMs, scale,
add, cast back).

    shrink: xa = x @ A_g^T for every A_g of the group at once, one program per slice of K,
            the last program of each member adding the slices' partial sums up
    expand: y_g = base_g + xa_g @ B_g^T * scaling_g for every member (or, for gate/up,
            silu(y_gate) * y_up), rounded as PEFT and torch round

The expand also sums a base projection that arrives split over K (the NVFP4 kernels' fp32
partials), so the base's own reduction costs no launch either, and likewise xa's partial
sums where the NVFP4 launch ran the shrink itself (nvfp4_gemv.cu). Rounding follows PEFT's
forward: x is cast to the adapter's dtype, x @ A^T and its product with B^T are rounded to
it, times scaling, plus the base output (rounded to its dtype first), and the sum is rounded
to the base's dtype. Only the order of each dot product's sum may differ.

For the rows of a decode step (its batch, up to MAX_ROWS): a shrink program holds up to
TILE_ROWS of them and one slice of K of one A, its loads unrolled (all in flight at once);
above TILE_ROWS rows, tiles of PIPELINED_ROWS through a software pipeline in shared memory
(the unrolled loads of 32-row tiles held registers and re-read A for every tile, slower
than the pipeline at those rows on an H100).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from qerl.kernels.device_facts import interpreting, num_sms
from qerl.kernels.rounding import round_as

MAX_ROWS = 512  # rows of a decode step the kernels take (RL samples up to ~512 at
# once); more -> PEFT's own forward
TILE_ROWS = 32  # rows a shrink program holds unrolled: more take registers the loads need
PIPELINED_ROWS = 64  # rows a shrink program holds above TILE_ROWS rows
STAGES = 3  # the pipelined shrink's loads in flight
MAX_RANK = 128
MAX_SPLITS = 64  # K slices of a shrink, and base partial sums an expand adds up (unrolled)
BLOCK_K = 64


@triton.jit
def _shrink_step(x_ptr, a_ptr, acc, M, K, R, rows, r, k, k_stop, stride_xm):
    k_ok = k < k_stop
    x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :],
                mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
    a = tl.load(a_ptr + r[:, None] * K + k[None, :], mask=(r[:, None] < R) & k_ok[None, :],
                other=0.0)
    x = round_as(x.to(tl.float32), a.dtype)
    # 3xTF32: fp32-accurate, as the FMA "ieee" dot is, but on the tensor cores.
    return tl.dot(x, tl.trans(a.to(tl.float32)), acc, input_precision="tf32x3")


@triton.jit
def _shrink_one(x_ptr, a_ptr, out_ptr, M, K, R, row0, col, k_start, k_stop, stride_xm,
                stride_om, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                ITERS: tl.constexpr, STAGES: tl.constexpr):
    rows = row0 + tl.arange(0, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if STAGES == 0:
        # Unrolled, so that the slice's loads are all in flight at once: a runtime loop
        # here waits one load latency per iteration.
        for i in tl.static_range(ITERS):
            acc = _shrink_step(x_ptr, a_ptr, acc, M, K, R, rows, r, k_start + i * BLOCK_K + kk,
                               k_stop, stride_xm)
    else:
        for k0 in tl.range(k_start, k_stop, BLOCK_K, num_stages=STAGES):
            acc = _shrink_step(x_ptr, a_ptr, acc, M, K, R, rows, r, k0 + kk, k_stop,
                               stride_xm)
    tl.store(out_ptr + rows[:, None] * stride_om + col + r[None, :], acc,
             mask=(rows[:, None] < M) & (r[None, :] < R))


@triton.jit
def _sum_member(part_ptr, out_ptr, M, R, row0, col, stride_ps, stride_pm, stride_om,
                SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = row0 + tl.arange(0, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    mask = (rows[:, None] < M) & (r[None, :] < R)
    at = rows[:, None] * stride_pm + col + r[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # in order: the sum is the same at every launch
        # .cg: from L2, where the other programs' stores are (L1 is not coherent)
        acc += tl.load(part_ptr + s * stride_ps + at, mask=mask, other=0.0,
                       cache_modifier=".cg")
    tl.store(out_ptr + rows[:, None] * stride_om + col + r[None, :], acc, mask=mask)


@triton.jit
def lora_shrink_kernel(x_ptr, a0_ptr, a1_ptr, a2_ptr, part_ptr, out_ptr, count_ptr, M, K, R,
                       per_split, stride_xm, stride_ps, stride_pm, stride_om,
                       GROUP: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ITERS: tl.constexpr,
                       STAGES: tl.constexpr):
    """Program (g, s, t): member g over slice s of K for row tile t (ITERS steps of
    BLOCK_K unrolled, or with STAGES > 0 pipelined), into partials
    [SPLITS, M, GROUP * R]; the last of a (member, row tile)'s programs to finish adds its
    SPLITS partials up into out [M, GROUP * R] (a counter each says which is last, and is
    left at 0)."""
    g = tl.program_id(0)
    s = tl.program_id(1)
    t = tl.program_id(2)
    row0 = t * BLOCK_M
    k_start = s * per_split
    k_stop = tl.minimum(K, k_start + per_split)
    part = part_ptr + s.to(tl.int64) * stride_ps
    # Triton cannot index a list of pointers at run time: one branch per member.
    if g == 0:
        _shrink_one(x_ptr, a0_ptr, part, M, K, R, row0, 0, k_start, k_stop, stride_xm, stride_pm,
                    BLOCK_M, BLOCK_R, BLOCK_K, ITERS, STAGES)
    if GROUP > 1:  # noqa: SIM102 (constexpr tests: Triton compiles the branches away)
        if g == 1:
            _shrink_one(x_ptr, a1_ptr, part, M, K, R, row0, R, k_start, k_stop, stride_xm,
                        stride_pm, BLOCK_M, BLOCK_R, BLOCK_K, ITERS, STAGES)
    if GROUP > 2:  # noqa: SIM102
        if g == 2:
            _shrink_one(x_ptr, a2_ptr, part, M, K, R, row0, 2 * R, k_start, k_stop, stride_xm,
                        stride_pm, BLOCK_M, BLOCK_R, BLOCK_K, ITERS, STAGES)
    if SPLITS > 1:
        tl.debug_barrier()  # every thread's partials stored before the release below
        counter = count_ptr + g * tl.num_programs(2) + t
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            _sum_member(part_ptr, out_ptr, M, R, row0, g * R, stride_ps, stride_pm, stride_om,
                        SPLITS, BLOCK_M, BLOCK_R)
            tl.atomic_xchg(counter, 0)


@triton.jit
def _expand_tile(xa_ptr, b_ptr, base_ptr, M, N, R, col, scaling, stride_xs, stride_xm,
                 stride_bs, stride_bm, rows, n, OUT_DTYPE: tl.constexpr,
                 XA_SPLITS: tl.constexpr, BASE_SPLITS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One member's [BLOCK_M, BLOCK_N] output tile, as fp32 holding OUT_DTYPE values."""
    r = tl.arange(0, BLOCK_R)
    row_ok = rows[:, None] < M
    n_ok = n < N
    lora_dtype = b_ptr.dtype.element_ty
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in tl.static_range(XA_SPLITS):  # in order: the sum is the same at every launch
        xa += tl.load(xa_ptr + s * stride_xs + rows[:, None] * stride_xm + col + r[None, :],
                      mask=row_ok & (r[None, :] < R), other=0.0)
    xa = round_as(xa, lora_dtype)
    b = tl.load(b_ptr + n[:, None] * R + r[None, :], mask=n_ok[:, None] & (r[None, :] < R),
                other=0.0)
    if PRECISION == "16-bit":
        # 16-bit operands holding 16-bit values: exact products, fp32 sums, as the "ieee"
        # dot below but on the tensor cores.
        delta = tl.dot(xa.to(lora_dtype), tl.trans(b))
    elif PRECISION == "tf32x3":
        # fp32 adapters (PEFT's default beside a 16-bit base): fp32-accurate on the tensor
        # cores, as the shrink; the "ieee" FMA dot's cost grows with the rank until, at high
        # ranks, it rivals the NVFP4 launch it follows.
        delta = tl.dot(xa, tl.trans(b), input_precision="tf32x3")
    else:
        delta = tl.dot(xa, tl.trans(b.to(tl.float32)), input_precision="ieee")
    delta = round_as(delta, lora_dtype)
    delta = round_as(delta * scaling, lora_dtype)
    base = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(BASE_SPLITS):
        base += tl.load(base_ptr + s * stride_bs + rows[:, None] * stride_bm + n[None, :],
                        mask=row_ok & n_ok[None, :], other=0.0).to(tl.float32)
    return round_as(round_as(base, OUT_DTYPE) + delta, OUT_DTYPE)


@triton.jit
def lora_expand_kernel(xa_ptr, b0_ptr, b1_ptr, b2_ptr, base0_ptr, base1_ptr, base2_ptr,
                       out_ptr, M, N0, N1, N2, R, col, scaling0, scaling1, scaling2,
                       stride_xs, stride_xm, stride_bs0, stride_bm0, stride_bs1, stride_bm1,
                       stride_bs2, stride_bm2, stride_om, GROUP: tl.constexpr,
                       SILU_MUL: tl.constexpr, XA_SPLITS: tl.constexpr,
                       BASE_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                       PRECISION: tl.constexpr):
    """Up to three members side by side in out's columns (member g after members 0 .. g-1,
    program_id(0) walking the column blocks of all of them), or with SILU_MUL one output
    silu(member 0) * member 1, rounded as torch rounds each of the two ops."""
    j = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows[:, None] < M
    out_dtype = out_ptr.dtype.element_ty
    out = out_ptr + rows[:, None] * stride_om
    blocks0 = tl.cdiv(N0, BLOCK_N)
    blocks1 = tl.cdiv(N1, BLOCK_N)
    if SILU_MUL:
        n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        gate = _expand_tile(xa_ptr, b0_ptr, base0_ptr, M, N0, R, col, scaling0,
                            stride_xs, stride_xm, stride_bs0, stride_bm0, rows, n, out_dtype,
                            XA_SPLITS, BASE_SPLITS, BLOCK_M, BLOCK_N, BLOCK_R, PRECISION)
        up = _expand_tile(xa_ptr, b1_ptr, base1_ptr, M, N1, R, col + R, scaling1,
                          stride_xs, stride_xm, stride_bs1, stride_bm1, rows, n, out_dtype,
                          XA_SPLITS, BASE_SPLITS, BLOCK_M, BLOCK_N, BLOCK_R, PRECISION)
        act = round_as(gate / (1.0 + tl.exp(-gate)), out_dtype)
        tl.store(out + n[None, :], (act * up).to(out_dtype), mask=row_ok & (n < N0)[None, :])
    else:
        # Triton cannot index a list of pointers at run time: one branch per member.
        if j < blocks0:
            n = j * BLOCK_N + tl.arange(0, BLOCK_N)
            y = _expand_tile(xa_ptr, b0_ptr, base0_ptr, M, N0, R, col, scaling0,
                             stride_xs, stride_xm, stride_bs0, stride_bm0, rows, n, out_dtype,
                             XA_SPLITS, BASE_SPLITS, BLOCK_M, BLOCK_N, BLOCK_R, PRECISION)
            tl.store(out + n[None, :], y.to(out_dtype), mask=row_ok & (n < N0)[None, :])
        if GROUP > 1:  # noqa: SIM102 (constexpr tests: Triton compiles the branches away)
            if j >= blocks0 and j < blocks0 + blocks1:
                n = (j - blocks0) * BLOCK_N + tl.arange(0, BLOCK_N)
                y = _expand_tile(xa_ptr, b1_ptr, base1_ptr, M, N1, R, col + R, scaling1,
                                 stride_xs, stride_xm, stride_bs1, stride_bm1, rows, n,
                                 out_dtype, XA_SPLITS, BASE_SPLITS, BLOCK_M, BLOCK_N,
                                 BLOCK_R, PRECISION)
                tl.store(out + N0 + n[None, :], y.to(out_dtype),
                         mask=row_ok & (n < N1)[None, :])
        if GROUP > 2:  # noqa: SIM102
            if j >= blocks0 + blocks1:
                n = (j - blocks0 - blocks1) * BLOCK_N + tl.arange(0, BLOCK_N)
                y = _expand_tile(xa_ptr, b2_ptr, base2_ptr, M, N2, R, col + 2 * R, scaling2,
                                 stride_xs, stride_xm, stride_bs2, stride_bm2, rows, n,
                                 out_dtype, XA_SPLITS, BASE_SPLITS, BLOCK_M, BLOCK_N,
                                 BLOCK_R, PRECISION)
                tl.store(out + N0 + N1 + n[None, :], y.to(out_dtype),
                         mask=row_ok & (n < N2)[None, :])


def _rank_block(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot needs 16 or more


def _splits(k: int, programs: int, device: torch.device) -> int:
    """K slices: one program per SM in all (``programs`` per slice). A program's time is the
    latency of its slice's loads, not their bytes, so more, shorter slices finish sooner."""
    return max(1, min(triton.cdiv(num_sms(device), programs), MAX_SPLITS,
                      triton.cdiv(k, BLOCK_K)))


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """The shrink's arrival counters on ``device``: zero between launches, which run one
    after another on a stream (decode steps do)."""
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # memory allocated in a capture belongs to that graph's pool
            raise RuntimeError("run the LoRA decode kernels once before capturing a CUDA "
                               "graph of them")
        # One per (member, row tile): above TILE_ROWS rows, tiles of PIPELINED_ROWS; else one.
        _COUNTERS[device] = torch.zeros(3 * triton.cdiv(MAX_ROWS, PIPELINED_ROWS),
                                        dtype=torch.int32, device=device)
    return _COUNTERS[device]


def _expand_block_n(rank: int) -> int:
    return 64 if rank <= 32 else 32


def _expand_block_m(rows: int, rank: int) -> int:
    """Row tiles of the expand: from 128 rows at rank <= 32, tiles of 64 read each column
    block of B half as often (measured: kernels/DESIGN.md)."""
    if rows <= 16:
        return 16
    return 64 if rows >= 128 and rank <= 32 else 32


def _shrink_warps(rank: int) -> int:
    """Above rank 32 a program's A tiles and 3xTF32 parts are twice as many registers:
    8 warps hold them."""
    return 8 if rank > 32 else 4


def lora_shrink(x: torch.Tensor, a_weights: list[torch.Tensor],
                splits: int | None = None) -> torch.Tensor:
    """x [M, K] and up to three A [R, K] (one rank and dtype) -> x @ A_g^T in fp32 as
    [M, len(A) * R], member g in columns g*R .. (g+1)*R. Computed over ``splits``
    slices of K (by default from the shapes) whose partial sums the kernel adds up itself:
    an expand then reads one sum instead of every slice's, which every one of its programs
    would re-read."""
    m, k = x.shape
    rank = a_weights[0].shape[0]
    if not 1 <= len(a_weights) <= 3:
        raise ValueError(f"a group has 1 to 3 adapters, got {len(a_weights)}")
    if any(a.shape != (rank, k) or a.dtype != a_weights[0].dtype or a.stride(-1) != 1
           or a.stride(0) != k for a in a_weights):
        raise ValueError(f"every A must be a contiguous [{rank}, {k}] of one dtype")
    if m > MAX_ROWS or rank > MAX_RANK or x.stride(-1) != 1:
        raise ValueError(f"the decode kernels take up to {MAX_ROWS} contiguous rows and "
                         f"rank {MAX_RANK}; got {m} rows, rank {rank}")
    pipelined = m > TILE_ROWS
    block_m = PIPELINED_ROWS if pipelined else max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(m, block_m)
    if splits is None:
        splits = _splits(k, len(a_weights) * tiles, x.device)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be 1 to {MAX_SPLITS}, got {splits}")
    per_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(k, per_split)
    out = torch.empty((m, len(a_weights) * rank), dtype=torch.float32, device=x.device)
    parts = out[None] if splits == 1 else torch.empty((splits, *out.shape),
                                                      dtype=torch.float32, device=x.device)
    padded = a_weights + [a_weights[0]] * (3 - len(a_weights))
    lora_shrink_kernel[(len(a_weights), splits, tiles)](
        x, *padded, parts, out, _counters(x.device), m, k, rank, per_split, x.stride(0),
        parts.stride(0), parts.stride(1), out.stride(0), GROUP=len(a_weights),
        SPLITS=splits, BLOCK_M=block_m,
        BLOCK_R=_rank_block(rank), BLOCK_K=BLOCK_K,
        ITERS=0 if pipelined else per_split // BLOCK_K, STAGES=STAGES if pipelined else 0,
        num_warps=_shrink_warps(rank))
    return out


def lora_expand(xa: torch.Tensor, member: int, b_weight: torch.Tensor, scaling: float,
                base: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """base [splits, M, N] (a base projection's partial sums, or [1, M, N] in its own
    dtype) + (the shrink's xa [M, G * R], or its partial sums [S, M, G * R], member
    ``member``) @ B^T * scaling -> [M, N] in ``out_dtype``."""
    return lora_expand_group(xa, [b_weight], [scaling], [base], out_dtype, first=member)[0]


def lora_expand_group(xa: torch.Tensor, b_weights: list[torch.Tensor], scalings: list[float],
                      bases: list[torch.Tensor], out_dtype: torch.dtype, first: int = 0,
                      silu_mul: bool = False) -> list[torch.Tensor]:
    """``lora_expand`` of xa's members first, first + 1, .. (up to three, one rank) in one
    launch: their outputs as column views of one [M, sum of N] buffer; with ``silu_mul``
    (two members, gate and up) the single output silu(gate) * up instead. Every base has
    the same number of partial sums."""
    parts = xa[None] if xa.dim() == 2 else xa  # the shrink's partial sums, added in order
    m = parts.shape[1]
    rank = b_weights[0].shape[1]
    widths = [b.shape[0] for b in b_weights]
    if not 1 <= len(b_weights) <= 3 or len(scalings) != len(b_weights) or len(bases) != len(
            b_weights):
        raise ValueError(f"a group has 1 to 3 members with one B, scaling and base each, got "
                         f"{len(b_weights)}, {len(scalings)}, {len(bases)}")
    if silu_mul and (len(b_weights) != 2 or widths[0] != widths[1]):
        raise ValueError(f"silu_mul takes two members of one width (gate, up), got {widths}")
    for base, n in zip(bases, widths, strict=True):
        if base.dim() != 3 or base.shape[1:] != (m, n) or base.stride(-1) != 1:
            raise ValueError(f"base must be [splits, {m}, {n}] with contiguous rows, got "
                             f"{tuple(base.shape)}")
    if len({base.shape[0] for base in bases}) != 1:
        raise ValueError("every base of a group must have the same number of partial sums")
    if bases[0].shape[0] > MAX_SPLITS:
        raise ValueError(f"at most {MAX_SPLITS} partial sums, got {bases[0].shape[0]}")
    if (xa.dim() not in (2, 3) or parts.shape[-1] < (first + len(b_weights)) * rank
            or parts.shape[0] > MAX_SPLITS or xa.stride(-1) != 1):
        raise ValueError(f"xa must be the shrink's [M, G * {rank}] (or up to {MAX_SPLITS} "
                         f"partial sums of it) with members {first}.."
                         f"{first + len(b_weights) - 1}, got {tuple(xa.shape)}")
    if any(b.shape[1] != rank or b.stride() != (rank, 1) for b in b_weights):
        raise ValueError("every B must be contiguous, of one rank")
    width = widths[0] if silu_mul else sum(widths)
    if b_weights[0].dtype == torch.float32:
        precision = "tf32x3"
    else:  # (the interpreter computes 16-bit dots wrongly: there the fp32 FMA path runs)
        precision = "ieee" if interpreting() else "16-bit"
    out = torch.empty((m, width), dtype=out_dtype, device=xa.device)
    block_m = _expand_block_m(m, rank)
    block_n = _expand_block_n(rank)
    blocks = triton.cdiv(widths[0], block_n) if silu_mul else sum(
        triton.cdiv(n, block_n) for n in widths)
    pad = 3 - len(b_weights)
    b_all = b_weights + [b_weights[0]] * pad
    base_all = bases + [bases[0]] * pad
    lora_expand_kernel[(blocks, triton.cdiv(m, block_m))](
        parts, *b_all, *base_all, out, m, *(widths + [0] * pad), rank, first * rank,
        *(list(scalings) + [0.0] * pad), parts.stride(0), parts.stride(1),
        *[stride for base in base_all for stride in base.stride()[:2]], out.stride(0),
        GROUP=len(b_weights), SILU_MUL=silu_mul, XA_SPLITS=parts.shape[0],
        BASE_SPLITS=bases[0].shape[0],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_rank_block(rank),
        PRECISION=precision, num_warps=4)
    if silu_mul:
        return [out]
    starts = [0, *itertools.accumulate(widths)]
    return [out[:, a:b] for a, b in itertools.pairwise(starts)]
