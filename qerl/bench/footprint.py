"""Where one RL step's GPU memory goes, estimated from the architecture alone (no GPU): what
to try before a long run, and what took the memory of one that ran out.

    qerl bench footprint --archs qwen2.5-72b --methods qerl --prompts 1 --micro-batch 8,2,1
    qerl bench footprint --archs qwen2.5-7b,qwen2.5-32b \\
        --measured results/bench/efficiency_NVIDIA_H100_80GB_HBM3.csv
    qerl bench footprint --archs qwen2.5-7b --prompts 1 --micro-batch 1 --measures

The terms (decimal GB) and what they model: qerl.rl.footprint, for P prompts x G
completions of L tokens after a prompt of --prompt-len, all P x G in the rollout's KV cache,
trained in micro-batches with gradient checkpointing (as `qerl bench step --grad-ckpt`).
tests/test_bench_cli.py holds the estimate within 10% of every committed `qerl bench step`
measurement.
``--measured`` adds the measured peak of runs with the same settings beside each row.
``--measures`` adds, after each row, the same step with a memory budget's measures taken one
by one in the order a plan takes them (qerl.rl.budget.MEASURES; those the model and
optimizer allow): what each one saves (column ``measures``, "+"-joined, or none).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qerl.help_format import HelpFormatter
from qerl.methods import LORA_METHODS
from qerl.rl.budget import measures_for, measures_label, with_measures
from qerl.rl.footprint import Step


def estimate(arch: str, method: str, prompts: int, generations: int, completion: int,
             micro_batch: int, prompt_len: int = 64, rank: int = 32,
             measures: tuple[str, ...] = ()) -> dict[str, float]:
    """The terms of one step's peak GPU memory (GB) and their total, with a memory
    budget's ``measures`` (qerl.rl.budget.MEASURES) taken."""
    from qerl.archs import config_for

    return with_measures(config_for(arch), Step(method, prompts * generations, micro_batch,
                                                prompt_len, completion, rank), measures)


def measured_peaks(path: Path):
    """The newest measured peak of each (model, method, settings) in a `qerl bench step`
    CSV."""
    import pandas as pd

    from qerl.report.collect import step_settings

    frame = pd.read_csv(path)
    frame = frame[frame.grad_ckpt == 1].drop_duplicates(
        ["model", "method", *step_settings(frame)], keep="last")
    return {(r.model, r.method, r.prompts, r.generations, r.completion, r.micro_batch,
             r.lora_rank): (r.status, r.peak_gb) for r in frame.itertuples()}


def main(argv: list[str] | None = None) -> None:
    import pandas as pd

    from qerl.archs import config_for
    from qerl.bench.step import step_arguments

    parser = argparse.ArgumentParser(prog="qerl bench footprint", description=__doc__,
                                     formatter_class=HelpFormatter)
    step_arguments(parser, prompts=2)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--micro-batch", default="8", help="one or more, e.g. 8,2,1")
    parser.add_argument("--measured", type=Path, help="a `qerl bench step` CSV to compare")
    parser.add_argument("--measures", action="store_true",
                        help="also each step with a memory budget's measures, one by one")
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
        options = measures_for(config_for(arch), "adamw_torch") if args.measures else ()
        for method in args.methods.split(","):
            for micro_batch in (int(m) for m in args.micro_batch.split(",")):
                key = (arch, method, args.prompts, args.generations, args.completion,
                       micro_batch, args.rank)
                for taken in range(len(options) + 1):
                    measures = options[:taken]
                    # A measured step took none of them.
                    status, peak = measured.get(key, (None, None)) if not measures else (
                        None, None)
                    rows.append({
                        "model": arch, "method": method, "prompts": args.prompts,
                        "generations": args.generations, "completion": args.completion,
                        "micro_batch": micro_batch, "lora_rank": args.rank,
                        "measures": measures_label(measures),
                        **{k: round(v, 2) for k, v in estimate(
                            arch, method, args.prompts, args.generations, args.completion,
                            micro_batch, args.prompt_len, args.rank, measures).items()},
                        "measured_status": status, "measured_peak_gb": peak})
    frame = pd.DataFrame(rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = f"footprint_P{args.prompts}_G{args.generations}_L{args.completion}.csv"
    frame.to_csv(args.out_dir / name, index=False)
    print(frame.to_markdown(index=False, floatfmt=".3g"))


if __name__ == "__main__":
    main()
