"""Sampling a token per row of logits, and its log-probability, in two launches.

torch's way (``log_softmax``, ``softmax``, ``multinomial``, ``gather``) is ~20 kernels over
[B, V] in fp32; at a decode step's few rows its softmaxes run one block per row (16 blocks
on 132 SMs at batch 16), so most of the card idles while they read the logits. Here the
vocabulary is split over many programs:

    partial: per (row, slice of V) the running max and sum of exp of logits / T (online
             log-sum-exp), and the slice's winner of an exponential race: the argmax of
             logits / T + Gumbel noise, which is a draw from softmax(logits / T)
    combine: per row, the winner over the slices and log p = logits[token] / T - lse

Temperature 0 is greedy: the first maximal logit and the plain log-softmax, as
``torch.argmax`` and ``torch.log_softmax`` give. The noise is Philox keyed by a seed the
caller draws from its torch generator on the device each step, so seeded rollouts repeat
and no step waits for the host; each Philox call's four outputs serve four consecutive
columns (``tl.rand4x``): one call a column, ten rounds for one number, was most of the
kernel's work at RL's batch sizes. Log-probabilities match torch's within
the order of their sums; NaN logits give NaN log-probabilities (torch's sampler would
assert on the device instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels.device_facts import num_sms

BLOCK = 1024
MAX_SLICES = 128
SLICE_BLOCKS = 16


@triton.jit
def _uniforms(seed, counters, BLOCK: tl.constexpr):
    """[BLOCK] uniforms in [0, 1): column 4 j + q of the block gets output q of Philox
    counter j of ``counters``."""
    u0, u1, u2, u3 = tl.rand4x(seed, counters)
    # join stacks on a new last axis: element [j, b, a] is u_(2 b + a), which row-major
    # flattening puts at 4 j + 2 b + a
    return tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), (BLOCK,))


@triton.jit
def sample_partial_kernel(logits_ptr, seed_ptr, max_ptr, sum_ptr, key_ptr, index_ptr, V,
                          stride_row, temperature, per_slice,
                          GREEDY: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    slices = tl.num_programs(1)
    seed = tl.load(seed_ptr)
    start = piece * per_slice
    stop = tl.minimum(start + per_slice, V)
    cols = tl.arange(0, BLOCK)
    run_max = tl.full((), float("-inf"), tl.float32)
    run_sum = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_at = start
    lanes = tl.arange(0, BLOCK // 4)
    for i in tl.static_range(ITERS):
        first = start + i * BLOCK
        at = first + cols
        ok = at < stop
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + at, mask=ok,
                    other=float("-inf")).to(tl.float32)
        if not GREEDY:
            x = tl.math.div_rn(x, temperature)  # IEEE division, as torch's
        tile_max = tl.max(x, axis=0)
        new_max = tl.maximum(run_max, tile_max)
        # A tile wholly past V is all -inf: keep its terms at 0, not exp(-inf + inf).
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(x - safe), axis=0)
        run_max = new_max
        if GREEDY:
            key = x
        else:
            u = _uniforms(seed, row * tl.cdiv(V, 4) + first // 4 + lanes, BLOCK)
            key = x - tl.log(-tl.log(u))  # + Gumbel noise; u = 0 gives -inf, never drawn
        key = tl.where(ok, key, float("-inf"))
        tile_best = tl.max(key, axis=0)
        tile_at = start + i * BLOCK + tl.argmax(key, axis=0, tie_break_left=True)
        # Strictly greater: on a tie the earlier column wins, as torch.argmax's.
        better = tile_best > best
        best_at = tl.where(better, tile_at, best_at)
        best = tl.where(better, tile_best, best)
    out = row * slices + piece
    tl.store(max_ptr + out, run_max)
    tl.store(sum_ptr + out, run_sum)
    tl.store(key_ptr + out, best)
    tl.store(index_ptr + out, best_at)


@triton.jit
def sample_combine_kernel(logits_ptr, max_ptr, sum_ptr, key_ptr, index_ptr, token_ptr,
                          logprob_ptr, slices, stride_row, temperature,
                          GREEDY: tl.constexpr, SLICES: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, SLICES)
    ok = i < slices
    at = row * slices + i
    maxes = tl.load(max_ptr + at, mask=ok, other=float("-inf"))
    sums = tl.load(sum_ptr + at, mask=ok, other=0.0)
    keys = tl.load(key_ptr + at, mask=ok, other=float("-inf"))
    top = tl.max(maxes, axis=0)
    lse = top + tl.log(tl.sum(tl.where(ok, sums * tl.exp(maxes - top), 0.0), axis=0))
    # Slices are in column order, so the first maximal key is the first maximal column.
    winner = tl.argmax(keys, axis=0, tie_break_left=True)
    token = tl.sum(tl.where(i == winner, tl.load(index_ptr + at, mask=ok, other=0), 0),
                   axis=0)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32)
    if not GREEDY:
        x = tl.math.div_rn(x, temperature)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, x - lse)


def _slices(rows: int, vocab: int, device: torch.device, block: int) -> int:
    """Vocabulary slices per row: ~4 programs per SM in all, each at least one block and
    none longer than SLICE_BLOCKS blocks (a program's blocks are unrolled: long slices at
    many rows ran far below the card's rate, kernels/DESIGN.md)."""
    blocks = triton.cdiv(vocab, block)
    wanted = max(4 * num_sms(device) // rows, triton.cdiv(blocks, SLICE_BLOCKS))
    return max(1, min(MAX_SLICES, wanted, blocks))


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None,
           slices: int | None = None, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] int64, log-probabilities [B] fp32) drawn from
    softmax(logits / temperature) (greedy at temperature 0); the log-probability is
    log_softmax(logits / temperature) at the token (plain log_softmax when greedy).
    ``slices`` of the vocabulary per row: by default ~4 programs per SM in all and at most
    SLICE_BLOCKS blocks each, each walking its slice ``block`` logits at a time (a power of
    two, at least 4)."""
    if logits.dim() != 2 or logits.shape[0] == 0 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [rows, vocab] with both > 0, got "
                         f"{tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        raise ValueError("the vocabulary dim of the logits must be contiguous")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if block < 4 or block & (block - 1):
        raise ValueError(f"block must be a power of two of at least 4, got {block}")
    rows, vocab = logits.shape
    slices = slices or _slices(rows, vocab, logits.device, block)
    per_slice = triton.cdiv(triton.cdiv(vocab, slices), block) * block
    slices = triton.cdiv(vocab, per_slice)  # none empty
    greedy = temperature == 0
    # The key of the noise: drawn on the device from the caller's generator (or torch's
    # default one), so that a seeded rollout repeats and nothing waits for the host.
    seed = torch.randint(0, 2**62, (1,), device=logits.device, generator=generator)
    maxes, sums, keys = (torch.empty((rows, slices), dtype=torch.float32,
                                     device=logits.device) for _ in range(3))
    index = torch.empty((rows, slices), dtype=torch.int32, device=logits.device)
    sample_partial_kernel[(rows, slices)](
        logits, seed, maxes, sums, keys, index, vocab, logits.stride(0), float(temperature),
        per_slice, GREEDY=greedy, BLOCK=block, ITERS=per_slice // block, num_warps=4)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    sample_combine_kernel[(rows,)](
        logits, maxes, sums, keys, index, tokens, logprobs, slices, logits.stride(0),
        float(temperature), GREEDY=greedy, SLICES=triton.next_power_of_2(slices), num_warps=1)
    return tokens, logprobs
