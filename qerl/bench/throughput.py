"""What the rollout benchmarks share: random prompts for each call of a row, an engine for
the batches that fit, a timed call, and a row for one batch and length: generated tokens per
second (prefill included), the time to the first token, and a decode step's time."""

from __future__ import annotations

import argparse
import time

import torch

from qerl.formats.kv_cache import DEFAULT as DEFAULT_KV_CACHE
from qerl.formats.kv_cache import KV_CACHES


def add_fused_argument(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--fused", default=default,
                        help="engine runs with our decode kernels (1) and/or the model's "
                             "own modules (0)")


def fused_modes(parser: argparse.ArgumentParser, text: str) -> tuple[bool, ...]:
    """--fused's engines in order (True: our decode kernels), or the parser's error."""
    if any(f not in ("0", "1") for f in text.split(",")):
        parser.error(f"--fused takes 1, 0 or both (1,0), got {text!r}")
    return tuple(f == "1" for f in text.split(","))


def add_kv_cache_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache", default=DEFAULT_KV_CACHE,
                        help=f"the engines' KV cache formats ({', '.join(KV_CACHES)}: "
                             "engine.kv_cache), comma-separated: each measured in this run "
                             "beside the others")


def kv_caches(parser: argparse.ArgumentParser, text: str) -> tuple[str, ...]:
    """--kv-cache's formats in order, each once, or the parser's error."""
    formats = tuple(text.split(","))
    if not set(formats) <= set(KV_CACHES) or len(set(formats)) < len(formats):
        parser.error(f"--kv-cache takes each of {', '.join(KV_CACHES)} at most once, "
                     f"comma-separated, got {text!r}")
    return formats


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


CALLS = ("warm-up", "first token", "timed")  # a row's calls, in order


def call_prompts(batch: int, length: int, vocab: int, group: int = 1
                 ) -> dict[str, list[list[int]]]:
    """A row's prompts for each of its CALLS: batch / ``group`` prompts, each ``group``
    times in a row (GRPO's completions of a prompt, as TRL's sampler orders them). Each
    call's set is drawn afresh: an engine that caches prefixes (vLLM does by default) would
    find a repeated set in its cache and skip its prefill, which a rollout of new prompts,
    as each RL step is, pays."""
    if group < 1 or batch % group:
        raise ValueError(f"a batch of {batch} is not a whole number of groups of {group}")
    return {call: [p for p in random_prompts(batch // group, length, vocab,
                                             seed=batch * len(CALLS) + i)
                   for _ in range(group)]
            for i, call in enumerate(CALLS)}


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
                   first_token_s: float, peak: bool = True) -> dict:
    """A result: ``seconds`` for the whole call and ``first_token_s`` for one that stops at
    its first token (prefill and one sample), whose difference over the other tokens is
    the decode step (step_ms). peak_gb (with ``peak``) is the most GPU memory this process
    allocated since the last ``timed`` call began (model, KV cache and activations: what
    must fit)."""
    step_ms = (seconds - first_token_s) / (gen_len - 1) * 1e3 if gen_len > 1 else None
    row = {"batch": batch, "prompt_len": prompt_len, "gen_len": gen_len,
           "seconds": round(seconds, 3), "tok_per_s": round(batch * gen_len / seconds, 1),
           "first_token_s": round(first_token_s, 3),
           "step_ms": None if step_ms is None else round(step_ms, 3),
           "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if peak else None}
    step = "" if step_ms is None else f", {step_ms:.2f} ms a step"
    print(f"  {label}batch {batch} prompt {prompt_len}: {row['tok_per_s']} tok/s (first "
          f"token {first_token_s:.3f} s{step})", flush=True)
    return row
