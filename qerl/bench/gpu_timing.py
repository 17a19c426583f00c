"""Timing one op on the GPU as a forward pass meets it: replayed from a CUDA graph, its
operands read from HBM (never from the L2 cache), beside the copy bandwidth that bounds it."""

from __future__ import annotations

import itertools

import torch

# More than the L2 cache of the cards measured on: copies rotated through this many bytes
# are each evicted before their next use.
ROTATE_BYTES = 512 << 20


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200,
                                 return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def rotating(make, nbytes: int):
    """A function returning, in turn, copies made by ``make`` that together exceed the L2
    cache, so that each call reads its operand from HBM."""
    copies = [make() for _ in range(max(2, -(-ROTATE_BYTES // nbytes)))]
    cycle = itertools.cycle(copies)
    return lambda: next(cycle)


def time_us(fn, graph: bool = True) -> float:
    """Median time of ``fn`` replayed from a CUDA graph: as a decode step runs it, without
    Python's launch overhead (which alone exceeds a small layer's GPU time). The naive
    baseline (torch dequantize, host-built lookup table) cannot be captured: timed eagerly."""
    import triton.testing

    if not graph:
        return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    with torch.cuda.stream(torch.cuda.Stream()):
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
