"""Rollout throughput: the embedded engine on BF16, NVFP4 and NF4 (QLoRA's) weights (LoRA
attached, unmerged, as during RL), Hugging Face generate on the BF16 model and vLLM on BF16
and NVFP4 (qerl/bench/vllm_rollout.py), at Qwen2.5 shapes with random weights.

    qerl bench rollout                              # -> results/bench/rollout_<card>.csv
    qerl bench rollout --archs qwen2.5-7b --batches 1,32 --prompt-lens 256 --gen-len 1024
    qerl bench rollout --archs qwen2.5-14b --weights bf16,nvfp4,nf4 --ranks 16,32,64 \\
        --batches 1 --prompt-lens 256     # the paper's throughput-by-rank figure
    qerl bench rollout --archs qwen2.5-7b --weights bf16,nvfp4,vllm-bf16,vllm-nvfp4 \\
        --ranks 32 --batches 1,32,128     # vLLM beside the engine (and without LoRA)
    qerl bench rollout --archs qwen2.5-7b --weights bf16,nvfp4 --ranks 32 \\
        --batches 64,128,256 --group 8    # as GRPO samples: 8 completions of each prompt
    qerl bench rollout --archs qwen2.5-7b --weights nvfp4,vllm-bf16 --ranks 32 \\
        --vllm-ranks 0 --kv-cache bf16,fp8  # the 8-bit KV cache beside BF16's, on both
    qerl report                           # its tables and figures, with the paper's numbers

Every sequence runs to gen_len (EOS ignored), sampling at temperature 1; tokens/s counts
generated tokens over the whole call (prefill included), after one warm-up call of the
same length that captures the decode step's CUDA graphs (one per 256 slots of context, as
a training run has them after its first rollout; vLLM's rows warm up with a short call, as
vLLM captures its graphs when it starts). A call that stops at the first token times the
prefill (first_token_s); the rest of the whole call over its other tokens is the decode
step (step_ms). Each call has prompts of its own, so that vLLM's prefix cache (on by
default) holds none of them: every engine pays the prefill, as for an RL step's new
prompts. Hugging Face generate runs the bare BF16
model with its default (dynamic) cache, at --hf-gen-len tokens, batch sizes up to
--hf-max-batch.

``--kv-cache`` names the KV cache formats (``kv_cache``, qerl/formats/kv_cache.py), each
measured in this run beside the others: the engine's ``Engine(kv_cache=...)``, vLLM's
``kv_cache_dtype`` (qerl/bench/vllm_rollout.py); Hugging Face generate's rows keep its own
cache, in the model's BF16.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from qerl.bench.throughput import (
    add_fused_argument,
    add_kv_cache_argument,
    call_prompts,
    fused_modes,
    kv_caches,
    largest_engine,
    throughput_row,
    timed,
)
from qerl.bench.vllm_rollout import KINDS as VLLM_KINDS
from qerl.bench.vllm_rollout import bench_vllm
from qerl.config import LoraSettings
from qerl.formats.kv_cache import DEFAULT as DEFAULT_KV_CACHE
from qerl.help_format import HelpFormatter
from qerl.policy import build_policy
from qerl.record import append_rows, per_card, provenance
from qerl.report.run import summary
from qerl.rollout import SamplingParams

WEIGHTS = {"bf16": "lora", "nvfp4": "qerl", "nf4": "qlora"}  # engine weights -> policy method


def bench_engine(policy, batches, prompt_lens, gen_len, fused: bool, group: int = 1,
                 kv_cache: str = DEFAULT_KV_CACHE) -> list[dict]:
    vocab = policy.config.vocab_size
    engine, fit = largest_engine(policy, batches, max(prompt_lens) + gen_len, fused=fused,
                                 kv_cache=kv_cache)
    rows = []
    for prompt_len in prompt_lens:
        for batch in fit:
            prompts = call_prompts(batch, prompt_len, vocab, group)
            params = SamplingParams(max_new_tokens=gen_len, ignore_eos=True, seed=0)
            engine.generate(prompts["warm-up"], params)  # captures the step's graphs
            first = timed(lambda p=prompts, s=params: engine.generate(
                p["first token"], replace(s, max_new_tokens=1)))
            seconds = timed(lambda p=prompts, s=params: engine.generate(p["timed"], s))
            rows.append(throughput_row("", batch, prompt_len, gen_len, seconds, first))
    return rows


def bench_hf(model, batches, prompt_lens, gen_len, group: int = 1) -> list[dict]:
    rows = []
    for prompt_len in prompt_lens:
        for batch in batches:
            prompts = {call: torch.tensor(ids, device="cuda") for call, ids in
                       call_prompts(batch, prompt_len, model.config.vocab_size,
                                    group).items()}

            def run(call: str, tokens: int, prompts=prompts):
                ids = prompts[call]
                model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                               max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)

            with torch.no_grad():
                run("warm-up", 2)
                first = timed(lambda: run("first token", 1))
                seconds = timed(lambda: run("timed", gen_len))
            rows.append(throughput_row("hf ", batch, prompt_len, gen_len, seconds, first))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="qerl bench rollout", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("results/bench"))
    parser.add_argument("--archs", default="qwen2.5-7b,qwen2.5-14b,qwen2.5-32b")
    parser.add_argument("--weights", default="bf16,nvfp4,hf-bf16")
    parser.add_argument("--ranks", default="16,32,64")
    parser.add_argument("--batches", default="1,16,32,64,128,256")
    parser.add_argument("--prompt-lens", default="256,1024")
    parser.add_argument("--gen-len", type=int, default=1024)
    parser.add_argument("--group", type=int, default=1,
                        help="G: a batch is batch / G prompts, each G times (GRPO's groups; "
                             "the engine prefills a prompt once, vLLM caches it); 1: every "
                             "prompt distinct")
    parser.add_argument("--hf-gen-len", type=int, default=256)
    parser.add_argument("--hf-max-batch", type=int, default=32)
    add_fused_argument(parser, "1")
    add_kv_cache_argument(parser)
    parser.add_argument("--vllm-ranks", default=None,
                        help="LoRA ranks of the vllm-* rows, 0 for no adapter (default: "
                             "--ranks and 0)")
    parser.add_argument("--vllm-memory", type=float, default=0.85,
                        help="share of the card vLLM may take (its KV cache fills it)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the vllm-* rows' exports go while they run (default: "
                             "the system's temporary folder; a 32B NVFP4 one is ~20 GB)")
    args = parser.parse_args(argv)
    engines = fused_modes(parser, args.fused)
    caches = kv_caches(parser, args.kv_cache)
    batches = [int(b) for b in args.batches.split(",")]
    if args.group < 1 or any(b % args.group for b in batches):
        parser.error(f"--group {args.group} must divide every batch ({args.batches})")
    if not torch.cuda.is_available():
        raise SystemExit("qerl bench rollout: needs a CUDA GPU (none found)")
    if args.workdir is not None:  # made now, not found missing after the engine's rows
        args.workdir.mkdir(parents=True, exist_ok=True)
    base = provenance("cuda")
    prompt_lens = [int(p) for p in args.prompt_lens.split(",")]
    weights = args.weights.split(",")
    unknown = sorted(set(weights) - {*WEIGHTS, "hf-bf16", *VLLM_KINDS})
    if unknown:
        raise SystemExit(f"qerl bench rollout: unknown --weights {', '.join(unknown)}")
    ranks = [int(r) for r in args.ranks.split(",")]
    vllm_ranks = ([int(r) for r in args.vllm_ranks.split(",")] if args.vllm_ranks
                  else [0, *ranks])
    path = args.out_dir / per_card("rollout", base["card"])
    for arch in args.archs.split(","):
        for kind in weights:
            if kind in VLLM_KINDS:
                print(f"{arch} {kind} lora r{','.join(map(str, vllm_ranks))}", flush=True)
                with tempfile.TemporaryDirectory(dir=args.workdir, prefix="qerl-vllm-") as work:
                    rows = bench_vllm(arch, kind, vllm_ranks, batches, prompt_lens,
                                      args.gen_len, Path(work), memory=args.vllm_memory,
                                      group=args.group, caches=caches)
                append_rows(path, [{**base, "model": arch, "weights": kind, "fused": None,
                                    "group": args.group, **row} for row in rows])
                continue
            for rank in [0] if kind == "hf-bf16" else ranks:
                print(f"{arch} {kind} lora r{rank}", flush=True)
                if kind == "hf-bf16":
                    policy = build_policy("full", arch=arch, device="cuda")
                    rows = bench_hf(policy.model, [b for b in batches if b <= args.hf_max_batch],
                                    prompt_lens, args.hf_gen_len, args.group)
                    # its own dynamic cache, in the model's dtype, whatever --kv-cache
                    rows = [{"fused": 0, "kv_cache": "bf16", **row} for row in rows]
                else:
                    policy = build_policy(WEIGHTS[kind], arch=arch, device="cuda",
                                          lora=LoraSettings(rank=rank, alpha=rank))
                    rows = []
                    for kv_cache, fused in ((c, f) for c in caches for f in engines):
                        print(f" fused={int(fused)} {kv_cache} cache", flush=True)
                        rows += [{"fused": int(fused), "kv_cache": kv_cache, **row}
                                 for row in bench_engine(policy, batches, prompt_lens,
                                                         args.gen_len, fused, args.group,
                                                         kv_cache)]
                append_rows(path, [{**base, "model": arch, "weights": kind, "lora_rank": rank,
                                    "group": args.group, **row} for row in rows])
                del policy
                gc.collect()
                torch.cuda.empty_cache()
    print(summary("rollout", path))
    print(path)


if __name__ == "__main__":
    main()
