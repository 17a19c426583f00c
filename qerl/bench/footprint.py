"""Where one RL step's GPU memory goes, estimated from the architecture alone (no GPU): what
to try before a long run, and what took the memory of one that ran out.

    qerl bench footprint --archs qwen2.5-72b --methods qerl --prompts 1 --micro-batch 8,2,1
    qerl bench footprint --archs qwen2.5-7b,qwen2.5-32b \\
        --measured results/bench/efficiency_NVIDIA_H100_80GB_HBM3.csv

The terms (decimal GB), for P prompts x G completions of L tokens after a prompt of
--prompt-len, trained in micro-batches with gradient checkpointing (as `qerl bench step
--grad-ckpt`; without it every layer keeps its activations, which this does not model):
- weights: the decoder's projections in the method's format (BF16 2 bytes a weight; NVFP4
  and NF4 4 bits plus one 8- or 32-bit scale per 16 or 64: 0.5625 bytes), the rest in BF16;
- lora: the adapters in fp32 with their gradients and AdamW's two moments (16 bytes each);
- kv_cache: the rollout engine's cache, sized for all P x G sequences at full length;
- checkpointed: each layer's input for one micro-batch, kept for the backward pass;
- layer: one layer's activations while it is recomputed in the backward pass, the peak:
  for lora and qerl 4 intermediate-sized and 8 hidden-sized BF16 tensors a token (fitted
  to the measured 7B, 14B and 32B steps: LoRA added inside the GEMM, Liger's norm and
  SwiGLU); qlora's LoRA layer is PEFT's own, which keeps an fp32 copy of each projection's
  input for the adapter (six hidden-sized, one intermediate-sized: 12 and 2 BF16 tensors'
  worth more), so 6 and 20.
tests/test_bench_cli.py holds the estimate within 10% of every committed `qerl bench step`
measurement.
``--measured`` adds the measured peak of runs with the same settings beside each row.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qerl.help_format import HelpFormatter
from qerl.methods import LORA_METHODS

GB = 1e9
QUANTIZED_BYTES = 0.5 + 1 / 16  # 4-bit values + one 8-bit scale per 16 (NF4: 32-bit per 64)
TERMS = ("weights", "lora", "kv_cache", "checkpointed", "layer")


def estimate(arch: str, method: str, prompts: int, generations: int, completion: int,
             micro_batch: int, prompt_len: int = 64, rank: int = 32) -> dict[str, float]:
    """The terms of one step's peak GPU memory (GB) and their total."""
    from qerl.archs import config_for

    if method not in LORA_METHODS:
        raise ValueError(f"footprint models the LoRA methods {LORA_METHODS}, not {method!r}")

    c = config_for(arch)
    hidden, inter, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or hidden // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    shapes = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden),
              (hidden, inter), (hidden, inter), (inter, hidden)]
    projections = layers * sum(a * b for a, b in shapes)
    adapters = layers * sum(rank * (a + b) for a, b in shapes)
    dense = c.vocab_size * hidden * (1 if c.tie_word_embeddings else 2)
    tokens = prompt_len + completion
    terms = {
        "weights": projections * (2 if method == "lora" else QUANTIZED_BYTES)
        + dense * 2,
        "lora": adapters * 16,
        "kv_cache": layers * 2 * kv * 2 * prompts * generations * tokens,
        "checkpointed": layers * micro_batch * tokens * hidden * 2,
        "layer": micro_batch * tokens * ((6 * inter + 20 * hidden) if method == "qlora"
                                         else (4 * inter + 8 * hidden)) * 2,
    }
    terms = {k: v / GB for k, v in terms.items()}
    return {**terms, "total": sum(terms.values())}


def measured_peaks(path: Path):
    """The newest measured peak of each (model, method, settings) in a `qerl bench step`
    CSV."""
    import pandas as pd

    from qerl.report.collect import STEP_SETTINGS

    frame = pd.read_csv(path)
    frame = frame[frame.grad_ckpt == 1].drop_duplicates(["model", "method", *STEP_SETTINGS],
                                                       keep="last")
    return {(r.model, r.method, r.prompts, r.generations, r.completion, r.micro_batch,
             r.lora_rank): (r.status, r.peak_gb) for r in frame.itertuples()}


def main(argv: list[str] | None = None) -> None:
    import pandas as pd

    from qerl.bench.step import step_arguments

    parser = argparse.ArgumentParser(prog="qerl bench footprint", description=__doc__,
                                     formatter_class=HelpFormatter)
    step_arguments(parser, prompts=2)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--micro-batch", default="8", help="one or more, e.g. 8,2,1")
    parser.add_argument("--measured", type=Path, help="a `qerl bench step` CSV to compare")
    args = parser.parse_args(argv)
    if args.measured is not None and not args.measured.is_file():
        raise SystemExit(f"qerl bench footprint: --measured {args.measured} does not exist")

    unknown = set(args.methods.split(",")) - set(LORA_METHODS)
    if unknown:
        raise SystemExit(f"qerl bench footprint: methods are {', '.join(LORA_METHODS)}; "
                         f"not {', '.join(sorted(unknown))}")
    measured = measured_peaks(args.measured) if args.measured else {}
    rows = []
    for arch in args.archs.split(","):
        for method in args.methods.split(","):
            for micro_batch in (int(m) for m in args.micro_batch.split(",")):
                key = (arch, method, args.prompts, args.generations, args.completion,
                       micro_batch, args.rank)
                status, peak = measured.get(key, (None, None))
                rows.append({"model": arch, "method": method, "prompts": args.prompts,
                             "generations": args.generations, "completion": args.completion,
                             "micro_batch": micro_batch, "lora_rank": args.rank,
                             **{k: round(v, 2) for k, v in estimate(
                                 arch, method, args.prompts, args.generations,
                                 args.completion, micro_batch, args.prompt_len,
                                 args.rank).items()},
                             "measured_status": status, "measured_peak_gb": peak})
    frame = pd.DataFrame(rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = f"footprint_P{args.prompts}_G{args.generations}_L{args.completion}.csv"
    frame.to_csv(args.out_dir / name, index=False)
    print(frame.to_markdown(index=False, floatfmt=".3g"))


if __name__ == "__main__":
    main()
