"""One RL training step at the real Qwen2.5 shapes (random weights: speed and memory do not
depend on the values), timed by phase, with its peak GPU memory: P prompts x G completions
of L tokens each (random weights never stop early), then the log-probs, forward and
backward over micro-batches, and the optimizer — `qerl train` itself, a few steps.

    qerl bench step                                  # 7B: lora, qlora, qerl; G=8, L=2048
    qerl bench step --archs qwen2.5-32b --methods qerl --grad-ckpt
    qerl bench step --archs qwen2.5-7b --completion 512 --steps 2   # a quick look

Each (model, method) runs in its own process (a fresh GPU); one that runs out of memory is
recorded as such, with the memory it had reached. Rows go to
results/bench/efficiency_<card>.csv (the first step, which captures CUDA graphs and warms up, is
left out of the medians); the table beside it gives each method's step time against LoRA's
from the same run, and the paper's end-to-end speed beside it where it gives one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ("rollout", "score", "train", "optimizer")
METHODS = ("lora", "qlora", "qerl")
RESULT = ("status", "steps_measured", *(f"{p}_s" for p in PHASES), "step_s",
          "rollout_tok_per_s", "peak_gb", "error")


def run_config(args: argparse.Namespace, arch: str, method: str, workdir: Path) -> dict:
    """The training configuration of one measurement."""
    from qerl.tokenizer import stand_in_tokenizer

    tokenizer_dir = workdir / "tokenizer"
    stand_in_tokenizer().save_pretrained(tokenizer_dir)
    completions = args.prompts * args.generations
    return {
        "arch": arch, "tokenizer": str(tokenizer_dir), "method": method, "seed": 0,
        "output_dir": str(workdir / "run"), "device": args.device,
        "lora": {"rank": args.rank, "alpha": args.rank},
        "data": {"task": "arithmetic", "level": 1, "size": 4 * args.prompts},
        "rl": {"num_generations": args.generations, "max_prompt_length": 64,
               "max_completion_length": args.completion, "dynamic_sampling": False,
               "overlong": {"enabled": False}, "mask_truncated_completions": False},
        "train": {"max_steps": args.steps, "batch_size": args.micro_batch,
                  "gradient_accumulation_steps": completions // args.micro_batch,
                  "gradient_checkpointing": args.grad_ckpt, "save_steps": 10**9,
                  "report_to": []},
    }


def measure(args: argparse.Namespace, arch: str, method: str) -> dict:
    """Train ``args.steps`` steps in this process; the medians of steps 2.. (or the only
    step). Out of memory gives status 'oom' and the peak reached."""
    import pandas as pd
    import torch

    from qerl.config import parse_config
    from qerl.rl.run import METRICS, train

    with tempfile.TemporaryDirectory() as tmp:
        config = parse_config(run_config(args, arch, method, Path(tmp)))
        try:
            train(config)
        except torch.cuda.OutOfMemoryError as err:
            return {"status": "oom", "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9,
                                                      2), "error": str(err).split("\n")[0]}
        metrics = pd.read_csv(Path(tmp) / "run" / METRICS)
    steady = metrics[metrics.step > 1] if len(metrics) > 1 else metrics
    row = {"status": "ok", "steps_measured": len(steady)}
    for phase in PHASES:
        row[f"{phase}_s"] = round(steady[f"time/{phase}_s"].median(), 3)
    row["step_s"] = round(sum(row[f"{p}_s"] for p in PHASES), 3)
    row["rollout_tok_per_s"] = round(steady["rollout/tokens_per_s"].median(), 1)
    if "memory/peak_gb" in metrics:  # logged on CUDA
        row["peak_gb"] = round(metrics["memory/peak_gb"].max(), 2)
    return row


def table(rows: list[dict]) -> str:
    """Markdown: each method's step and phase times, and its step time against LoRA's."""
    import pandas as pd

    from qerl.report.run import PAPER

    frame = pd.DataFrame(rows)
    lora = frame[frame.method == "lora"].set_index("model").step_s
    frame["speed vs lora"] = [lora.get(m) / s if s and lora.get(m) else None
                              for m, s in zip(frame.model, frame.step_s, strict=True)]
    paper = pd.read_csv(PAPER)
    paper = paper[paper.metric == "end_to_end_speed"]
    speed = {(m.lower().removesuffix("-instruct"), method): v
             for m, method, v in zip(paper.model, paper.method, paper.value, strict=True)}
    frame["paper speed vs lora"] = [speed.get((m, method)) for m, method
                                    in zip(frame.model, frame.method, strict=True)]
    columns = ["model", "method", "status", *[f"{p}_s" for p in PHASES], "step_s",
               "speed vs lora", "paper speed vs lora", "rollout_tok_per_s", "peak_gb"]
    return frame[[c for c in columns if c in frame]].to_markdown(index=False, floatfmt=".3g")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="qerl bench step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("results/bench"))
    parser.add_argument("--archs", default="qwen2.5-7b")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--prompts", type=int, default=4, help="P: prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="G: completions each")
    parser.add_argument("--completion", type=int, default=2048, help="L: tokens each")
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="completions per forward/backward")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    parser.add_argument("--child", nargs=2, metavar=("ARCH", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # tests: cpu
    args = parser.parse_args(argv)
    if (args.prompts * args.generations) % args.micro_batch:
        parser.error("--micro-batch must divide prompts x generations")

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("qerl bench step: needs a CUDA GPU (none found)")
    if args.child:
        print(json.dumps(measure(args, *args.child)))
        return

    from qerl.bench.record import append_rows, provenance

    base = provenance(args.device)
    card = base["card"].replace(" ", "_")
    path = args.out_dir / f"efficiency_{card}.csv"
    settings = {"lora_rank": args.rank, "prompts": args.prompts,
                "generations": args.generations, "completion": args.completion,
                "micro_batch": args.micro_batch, "grad_ckpt": int(args.grad_ckpt)}
    rows = []
    own = list(argv if argv is not None else sys.argv[1:])
    for arch in args.archs.split(","):
        for method in args.methods.split(","):
            done = subprocess.run([sys.executable, "-m", "qerl.bench.step", *own,
                                   "--child", arch, method], capture_output=True, text=True)
            lines = done.stdout.strip().splitlines()
            try:
                result = json.loads(lines[-1])
            except (IndexError, json.JSONDecodeError):
                result = {"status": "failed", "error": done.stderr.strip()[-500:]}
            row = {**base, "model": arch, "method": method, **settings,
                   **{key: result.get(key) for key in RESULT}}
            print(json.dumps(row), flush=True)
            append_rows(path, [row])
            rows.append(row)
    (args.out_dir / f"efficiency_{card}.md").write_text(table(rows) + "\n")
    print(path)


if __name__ == "__main__":
    main()
