"""One rollout decode step, taken apart: its time as a CUDA-graph replay, the GPU kernels
it launches, their summed time and the five that take longest (an eager step, profiled),
and the time at least one kernel runs in a replay (``busy_ms``: kernels on a side stream,
such as the LoRA shrink beside cuBLAS, overlap the main stream's there), with the fused
kernels and with the model's own modules (``Engine(fused=...)``), at Qwen2.5 shapes with
random weights and LoRA attached. The replay's time less ``busy_ms`` is what the step
spends between kernels (each graph node's launch, a kernel waiting on the one before).

    qerl bench decode-step                 # -> results/bench/decode_step_<card>.csv
    qerl bench decode-step --archs qwen2.5-7b --batches 1,32 --slot 700
    qerl bench decode-step --kv-cache bf16,fp8   # the 8-bit KV cache beside BF16's

The cache holds ``--slot`` tokens of context (a mid-rollout step at prompt 256 / generate
1024). Kernels are counted by torch.profiler over one eager step, and their time summed by
the part of the step they do (``PARTS``: ``matmul_ms``, ``lora_ms``, ``attention_ms``,
``norm_ms``, ``other_ms``), beside the sampling of the step's tokens (``sampling_ms``, not
part of the replay). Beside each step, a prefill of ``--prefill-len`` tokens a sequence is
timed (``prefill_ms``, the median of up to five calls) with the time some kernel of it runs
(``prefill_busy_ms``): at few sequences the host launching the prefill's kernels, not the
GPU, can set its time. ``--kv-cache`` names the engine's KV cache formats (``kv_cache``,
qerl/formats/kv_cache.py), each measured in this run beside the others: an fp8 cache halves
the bytes the step's attention reads.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

from qerl.bench.rollout import WEIGHTS
from qerl.bench.throughput import (
    add_fused_argument,
    add_kv_cache_argument,
    fused_modes,
    kv_caches,
    largest_engine,
    timed,
)
from qerl.config import LoraSettings
from qerl.formats.kv_cache import DEFAULT as DEFAULT_KV_CACHE
from qerl.help_format import HelpFormatter
from qerl.policy import build_policy
from qerl.record import append_rows, per_card, provenance
from qerl.rollout import Engine, SamplingParams
from qerl.rollout.sampling_params import sample

# The parts of a step, told by their kernels' names (the first that matches): LoRA's own
# kernels, the projections' and lm_head's matmuls (ours, cuBLAS's and their split-K
# reductions), attention over the cache, the norms with rotary; casts, copies and
# reductions are "other". The model's own modules (fused=0) run LoRA as cuBLAS GEMMs and
# casts: there LoRA's time is in matmul and other.
PARTS = {
    "lora": ("lora_",),
    "matmul": ("nvfp4_", "nvjet", "gemm", "gemv", "cutlass", "splitkreduce", "xmma"),
    "attention": ("decode_split", "decode_combine", "sdpa", "flash", "fmha", "attention"),
    "norm": ("rms_norm", "rotary"),
}


def part_of(kernel: str) -> str:
    """The part of a decode step (a key of PARTS, or "other") a kernel's name says it does."""
    name = kernel.lower()
    return next((part for part, marks in PARTS.items() if any(m in name for m in marks)),
                "other")


def _replay_ms(engine: Engine, ids: torch.Tensor, slot: int, at: torch.Tensor,
               repeats: int = 20):
    engine._decode(ids, slot, at)  # captures the graph
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        engine._decode(ids, slot, at)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def busy_ms(spans: list[tuple[float, float]]) -> float:
    """The time (ms) covered by at least one of the (start, end) spans in us: the union of
    the kernels' intervals, so that overlapping ones count once."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1e3


def _profiled(fn):
    """torch.profiler's record of the GPU work of one call of fn."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof


def _device_events(prof) -> list:
    """The profile's kernels, longest first (the API calls carry no device time)."""
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(events, key=lambda e: -e.device_time_total)


def _kernels(engine: Engine, ids, slot: int, at: torch.Tensor, batch: int
             ) -> tuple[int, float, str, dict[str, float]]:
    """(kernels, their summed ms, the five longest, ms by part: ``PARTS`` and sampling) of
    one eager step."""
    cache = engine._view(batch, engine._span(slot))
    with torch.no_grad():
        logits = engine.decoder(ids, at, cache)
        torch.cuda.synchronize()
        events = _device_events(_profiled(lambda: engine.decoder(ids, at, cache)))
        draw = SamplingParams(max_new_tokens=1)  # temperature 1, as the rollouts sample

        def draw_tokens():
            return sample(logits, draw, None, fused=engine.decoder.fused)

        draw_tokens()
        sampling = _device_events(_profiled(draw_tokens))
    top = "; ".join(f"{e.key[:48]} x{e.count} {e.device_time_total / 1e3:.2f}ms"
                    for e in events[:5])
    parts = dict.fromkeys([*PARTS, "other"], 0.0)
    for e in events:
        parts[part_of(e.key)] += e.device_time_total / 1e3
    parts["sampling"] = sum(e.device_time_total for e in sampling) / 1e3
    summed_ms = sum(e.device_time_total for e in events) / 1e3
    return sum(e.count for e in events), summed_ms, top, parts


def _replay_busy_ms(engine: Engine, ids, slot: int, at: torch.Tensor, kernels: int
                    ) -> float | None:
    """busy_ms of one graph replay of the step, where its kernels overlap as they do when
    timed (an eager step profiled ran the side stream's beside none: its union equalled
    its sum). None where the profiler shows fewer kernels in the replay than the eager
    step launched: the union of some would pass for the step's."""
    spans = _kernel_spans(_profiled(lambda: engine._decode(ids, slot, at)))
    return busy_ms(spans) if len(spans) >= kernels else None


def _kernel_spans(prof) -> list[tuple[float, float]]:
    """(start, end) in us of each CUDA kernel a profile recorded."""
    from torch.autograd import DeviceType

    return [(e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == DeviceType.CUDA]


def _prefill_ms(engine: Engine, batch: int, length: int, budget_s: float = 1.0,
                most: int = 5) -> tuple[float, float]:
    """(wall ms, busy ms) of a prefill of ``batch`` new prompts of ``length`` tokens (after
    one of the same shape): the call's time, and the time some kernel of it runs; the rest
    is the GPU waiting on the host to launch them. The wall time is the median of as many
    calls as fit in ``budget_s`` (at least one, at most ``most``): a host-bound prefill's
    single call varies by tens of percent."""
    def prefill():
        ids = torch.randint(0, engine.model.config.vocab_size, (batch, length))
        engine._prefill(ids, torch.zeros(batch, dtype=torch.long))

    with engine._eval():
        first = timed(prefill)
        calls = max(1, min(most, int(budget_s / max(first, 1e-9))))
        wall = statistics.median(timed(prefill) for _ in range(calls)) * 1e3
        return wall, busy_ms(_kernel_spans(_profiled(prefill)))


def measure(arch: str, weights: str, rank: int, batches: list[int], slot: int,
            prefill_len: int, engines: tuple[bool, ...] = (True, False),
            caches: tuple[str, ...] = (DEFAULT_KV_CACHE,)) -> list[dict]:
    policy = build_policy(WEIGHTS[weights], arch=arch, device="cuda",
                          lora=LoraSettings(rank=rank, alpha=rank))
    rows = []
    for kv_cache, fused in ((c, f) for c in caches for f in engines):
        engine, fit = largest_engine(policy, batches, max(slot, prefill_len) + 2, fused=fused,
                                     kv_cache=kv_cache)
        for batch in fit:
            prompts = torch.randint(0, engine.model.config.vocab_size, (batch, slot)).tolist()
            engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
            ids = torch.zeros((batch, 1), dtype=torch.long, device=engine.device)
            at = torch.tensor(slot, device=engine.device)
            with engine._eval():
                step_ms = _replay_ms(engine, ids, slot, at)
                kernels, kernel_ms, top, parts = _kernels(engine, ids, slot, at, batch)
                busy = _replay_busy_ms(engine, ids, slot, at, kernels)
            prefill_ms, prefill_busy = _prefill_ms(engine, batch, prefill_len)
            rows.append({"model": arch, "weights": weights, "lora_rank": rank,
                         "fused": int(fused), "kv_cache": kv_cache, "batch": batch,
                         "context": slot,
                         "step_ms": round(step_ms, 3), "kernels": kernels,
                         "kernel_ms": round(kernel_ms, 3),
                         "busy_ms": None if busy is None else round(busy, 3),
                         **{f"{part}_ms": round(ms, 3) for part, ms in parts.items()},
                         "prefill_len": prefill_len, "prefill_ms": round(prefill_ms, 3),
                         "prefill_busy_ms": round(prefill_busy, 3), "top_kernels": top})
            print(f"  {weights} fused={int(fused)} {kv_cache} cache batch {batch}: "
                  f"{step_ms:.2f} ms, "
                  f"{kernels} kernels taking {kernel_ms:.2f} ms, busy in a replay "
                  f"{'(not seen)' if busy is None else f'{busy:.2f} ms'}; a prefill of "
                  f"{prefill_len} tokens {prefill_ms:.1f} ms, busy {prefill_busy:.1f} ms",
                  flush=True)
        del engine
        gc.collect()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="qerl bench decode-step", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("results/bench"))
    parser.add_argument("--archs", default="qwen2.5-7b")
    parser.add_argument("--weights", default="bf16,nvfp4")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--slot", type=int, default=700)
    parser.add_argument("--prefill-len", type=int, default=256,
                        help="prompt tokens of the prefill timed beside each step")
    add_fused_argument(parser, "1,0")
    add_kv_cache_argument(parser)
    args = parser.parse_args(argv)
    engines = fused_modes(parser, args.fused)
    caches = kv_caches(parser, args.kv_cache)
    if not torch.cuda.is_available():
        raise SystemExit("qerl bench decode-step: needs a CUDA GPU (none found)")
    base = provenance("cuda")
    path = args.out_dir / per_card("decode_step", base["card"])
    batches = [int(b) for b in args.batches.split(",")]
    for arch in args.archs.split(","):
        for weights in args.weights.split(","):
            rows = measure(arch, weights, args.rank, batches, args.slot, args.prefill_len,
                           engines, caches)
            append_rows(path, [{**base, **row} for row in rows])
            gc.collect()
            torch.cuda.empty_cache()
    print(path)


if __name__ == "__main__":
    main()
