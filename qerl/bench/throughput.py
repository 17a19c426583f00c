"""What the rollout benchmarks share: random prompts, an engine for the batches that fit, a
timed call, and a row of generated tokens per second (prefill included) for one batch and
length."""

from __future__ import annotations

import time

import torch


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


def largest_engine(policy, batches: list[int], max_seq_len: int, **kwargs):
    """(engine, batches): an engine for the largest of ``batches`` whose KV cache fits the
    device, and those it serves, in order; each larger one is named as not measured, where
    it would have ended the run and lost the rows of the batches before it."""
    from qerl.rollout import Engine
    from qerl.rollout.engine import CacheMemoryError

    for batch in sorted(set(batches), reverse=True):
        try:
            engine = Engine(policy, max_batch=batch, max_seq_len=max_seq_len, **kwargs)
        except CacheMemoryError as err:
            print(f"  batch {batch}: not measured: {err}", flush=True)
            continue
        return engine, [b for b in batches if b <= batch]
    return None, []


def timed(fn) -> float:
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    fn()
    if gpu:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def throughput_row(label: str, batch: int, prompt_len: int, gen_len: int, seconds: float,
                   peak: bool = True) -> dict:
    """A result; peak_gb (with ``peak``) is the most GPU memory this process allocated since
    the last ``timed`` call began (model, KV cache and activations: what must fit)."""
    row = {"batch": batch, "prompt_len": prompt_len, "gen_len": gen_len,
           "seconds": round(seconds, 3), "tok_per_s": round(batch * gen_len / seconds, 1),
           "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if peak else None}
    print(f"  {label}batch {batch} prompt {prompt_len}: {row['tok_per_s']} tok/s", flush=True)
    return row
