"""One RL training step at the real Qwen2.5 shapes (random weights: speed and memory do not
depend on the values), timed by phase, with its peak GPU memory: P prompts x G completions
of L tokens each (random weights never stop early), then the log-probs, forward and
backward over micro-batches, and the optimizer — `qerl train` itself, a few steps.

    qerl bench step                                  # 7B: lora, qlora, qerl; G=8, L=2048
    qerl bench step --archs qwen2.5-32b --methods qerl --grad-ckpt
    qerl bench step --archs qwen2.5-7b --completion 512 --steps 2   # a quick look

Each (model, method) runs in its own process (a fresh GPU); with --gpus 0,1,2,3 up to four
run at once, one per GPU (the GPUs must be of one model: the ratios compare like with like).
One that runs out of memory is recorded as such, with the memory it had reached. Rows go to
results/bench/efficiency_<card>.csv (the first step, which captures CUDA graphs and warms up, is
left out of the medians). At the end it prints the file's table (`qerl report` draws it
with the rest): each method's step time against LoRA's at the same model and settings
measured within an hour of it (the same run or back to back on one machine), and the
paper's end-to-end speed beside it where it gives one.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from qerl.help_format import HelpFormatter
from qerl.methods import LORA_METHODS
from qerl.rl.phases import PHASES

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


def gpu_env(gpus: list[str]) -> list[dict]:
    """One environment per GPU in ``gpus`` (indices among the visible ones), each seeing only
    that GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = visible.split(",") if visible else None
    envs = []
    for gpu in gpus:
        index = int(gpu)
        name = physical[index] if physical else str(index)
        envs.append({**os.environ, "CUDA_VISIBLE_DEVICES": name})
    return envs


def step_arguments(parser: argparse.ArgumentParser, prompts: int) -> None:
    """The options naming the steps measured or modelled (``qerl bench step`` and
    ``footprint``): where the CSV goes, the models, the methods, P x G x L and the rank."""
    parser.add_argument("--out-dir", type=Path, default=Path("results/bench"))
    parser.add_argument("--archs", default="qwen2.5-7b")
    parser.add_argument("--methods", default=",".join(LORA_METHODS))
    parser.add_argument("--prompts", type=int, default=prompts, help="P: prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="G: completions each")
    parser.add_argument("--completion", type=int, default=2048, help="L: tokens each")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="qerl bench step", description=__doc__,
                                     formatter_class=HelpFormatter)
    step_arguments(parser, prompts=4)
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="completions per forward/backward")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    parser.add_argument("--gpus", default="0",
                        help="GPUs to spread the (model, method) processes over, e.g. 0,1,2,3")
    parser.add_argument("--child", nargs=2, metavar=("ARCH", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # tests: cpu
    args = parser.parse_args(argv)
    if (args.prompts * args.generations) % args.micro_batch:
        parser.error("--micro-batch must divide prompts x generations")

    import torch

    gpus = args.gpus.split(",")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("qerl bench step: needs a CUDA GPU (none found)")
        if any(not g.isdigit() or int(g) >= torch.cuda.device_count() for g in gpus):
            raise SystemExit(f"qerl bench step: --gpus {args.gpus}, but "
                             f"{torch.cuda.device_count()} GPU(s) are visible")
        names = {torch.cuda.get_device_name(int(g)) for g in gpus}
        if len(names) > 1:
            raise SystemExit(f"qerl bench step: --gpus mixes card models {sorted(names)}; "
                             "ratios need one")
    if args.child:
        print(json.dumps(measure(args, *args.child)))
        return

    from qerl.record import append_rows, per_card, provenance
    from qerl.report.run import summary

    base = provenance(args.device)
    path = args.out_dir / per_card("efficiency", base["card"])
    settings = {"lora_rank": args.rank, "prompts": args.prompts,
                "generations": args.generations, "completion": args.completion,
                "micro_batch": args.micro_batch, "grad_ckpt": int(args.grad_ckpt)}
    own = list(argv if argv is not None else sys.argv[1:])
    free = queue.Queue()
    for env in gpu_env(gpus):
        free.put(env)

    def child(arch: str, method: str) -> dict:
        env = free.get()
        try:
            done = subprocess.run([sys.executable, "-m", "qerl.bench.step", *own, "--gpus",
                                   "0", "--child", arch, method], capture_output=True,
                                  text=True, env=env)
        finally:
            free.put(env)
        try:
            result = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            result = {"status": "failed", "error": done.stderr.strip()[-500:]}
        return {**base, "model": arch, "method": method, **settings,
                **{key: result.get(key) for key in RESULT}}

    jobs = [(arch, method) for arch in args.archs.split(",")
            for method in args.methods.split(",")]
    with ThreadPoolExecutor(max_workers=len(gpus)) as pool:
        for future in as_completed([pool.submit(child, *job) for job in jobs]):
            row = future.result()
            print(json.dumps(row), flush=True)
            append_rows(path, [row])
    print(summary("step", path))
    print(path)

if __name__ == "__main__":
    main()
