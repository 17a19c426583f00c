"""One RL training step at the real Qwen2.5 shapes (random weights: speed and memory do not
depend on the values), timed by phase, with its peak GPU memory: P prompts x G completions
of L tokens each (random weights never stop early), then the log-probs, forward and
backward over micro-batches, and the optimizer — `qerl train` itself, a few steps.

    qerl bench step                                  # 7B: lora, qlora, qerl; G=8, L=2048
    qerl bench step --archs qwen2.5-32b --methods qerl --grad-ckpt
    qerl bench step --archs qwen2.5-7b --completion 512 --steps 2   # a quick look
    qerl bench step --archs qwen2.5-14b --prompts 1 --memory-gb 18  # fitted to 18 GB
    qerl bench step --device cpu --model smollm2-135m-instruct --methods lora,qerl \\
        --prompts 2 --generations 4 --completion 16 --rank 16 --prompt-tokens 128 \\
        --busy 0,1                # the CPU path: train_smoke.yaml's step, alone and beside
                                  # a busy process

On a CPU (``--device cpu``) a real model (``--model``, its own tokenizer and arithmetic
prompts; its completions may stop early) stands in for the shapes, and ``--busy N`` starts
N processes that keep a core each busy while each measurement runs (a second job on the
machine, as CI and a test run beside a user's have): the rows record N, the cores and
the threads the steps ran on (qerl.cpu_threads chooses them).

Each (model, method) runs in its own process (a fresh GPU); with --gpus 0,1,2,3 up to four
run at once, one per GPU (the GPUs must be of one model: the ratios compare like with like).
One that runs out of memory is recorded as such, with the memory it had reached. With
``--memory-gb`` each step is fitted to that budget (qerl.rl.budget: the micro-batch, at
most --micro-batch, and the rollout's batch planned, checkpointing on, torch capped to it):
the row records the budget and the settings the plan chose, or "refused" and why (the
terms and the smallest budget that fits; `qerl bench budget` measures a grid of budgets
with the driver's peak). Rows go to
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
from contextlib import contextmanager
from pathlib import Path

from qerl.help_format import HelpFormatter
from qerl.methods import LORA_METHODS
from qerl.rl.phases import PHASES

RESULT = ("status", "steps_measured", *(f"{p}_s" for p in PHASES), "step_s",
          "rollout_tok_per_s", "peak_gb", "reserved_gb", "threads", "error")
# What a memory budget's plan chose: it replaces the options' settings in the row.
PLANNED = ("micro_batch", "grad_ckpt", "rollout_batch")
BUSY_LOOP = "while True: pass"


def run_config(args: argparse.Namespace, model: str, method: str, workdir: Path) -> dict:
    """The training configuration of one measurement: ``model`` is an architecture of
    random weights (with the stand-in tokenizer) or, with ``--model``, that model."""
    from qerl.tokenizer import stand_in_tokenizer

    if args.model:
        weights = {"model": model}
    else:
        tokenizer_dir = workdir / "tokenizer"
        stand_in_tokenizer().save_pretrained(tokenizer_dir)
        weights = {"arch": model, "tokenizer": str(tokenizer_dir)}
    completions = args.prompts * args.generations
    return {
        **weights, "method": method, "seed": 0,
        "output_dir": str(workdir / "run"), "device": args.device,
        "memory_gb": args.memory_gb, "engine": {"kv_cache": args.kv_cache},
        "lora": {"rank": args.rank, "alpha": args.rank},
        "data": {"task": "arithmetic", "level": 1, "size": 4 * args.prompts},
        "rl": {"num_generations": args.generations,
               "max_prompt_length": args.prompt_tokens,
               "max_completion_length": args.completion, "dynamic_sampling": False,
               "overlong": {"enabled": False}, "mask_truncated_completions": False},
        "train": {"max_steps": args.steps, "batch_size": args.micro_batch,
                  "gradient_accumulation_steps": completions // args.micro_batch,
                  "gradient_checkpointing": args.grad_ckpt, "save_steps": 10**9,
                  "report_to": []},
    }


def measure(args: argparse.Namespace, model: str, method: str) -> dict:
    """Train ``args.steps`` steps in this process; the medians of steps 2.. (or the only
    step), and under a budget the settings its plan chose. Out of memory gives status 'oom'
    and the peak reached; a budget the step cannot fit, 'refused' and why."""
    import pandas as pd
    import torch

    from qerl.config import parse_config
    from qerl.rl.budget import BudgetError
    from qerl.rl.run import MEMORY_PLAN, METRICS, train

    with tempfile.TemporaryDirectory() as tmp:
        config = parse_config(run_config(args, model, method, Path(tmp)))
        plan_file = Path(tmp) / "run" / MEMORY_PLAN
        try:
            train(config)
        except BudgetError as err:
            return {"status": "refused", "error": str(err)}
        except torch.cuda.OutOfMemoryError as err:
            return {"status": "oom", "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9,
                                                      2),
                    "reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2),
                    "error": str(err).split("\n")[0], **_planned(plan_file)}
        metrics = pd.read_csv(Path(tmp) / "run" / METRICS)
        planned = _planned(plan_file)
    steady = metrics[metrics.step > 1] if len(metrics) > 1 else metrics
    row = {"status": "ok", "steps_measured": len(steady)}
    for phase in PHASES:
        row[f"{phase}_s"] = round(steady[f"time/{phase}_s"].median(), 3)
    row["step_s"] = round(sum(row[f"{p}_s"] for p in PHASES), 3)
    row["rollout_tok_per_s"] = round(steady["rollout/tokens_per_s"].median(), 1)
    if "memory/peak_gb" in metrics:  # logged on CUDA
        row["peak_gb"] = round(metrics["memory/peak_gb"].max(), 2)
        row["reserved_gb"] = round(metrics["memory/reserved_peak_gb"].max(), 2)
    if "cpu/threads" in metrics:  # logged on a CPU
        row["threads"] = float(steady["cpu/threads"].median())
    return {**row, **planned}


def _planned(plan_file: Path) -> dict:
    """The settings a memory budget's plan chose (memory_plan.json), if there was one."""
    if not plan_file.is_file():
        return {}
    plan = json.loads(plan_file.read_text())
    return {"micro_batch": plan["micro_batch"], "rollout_batch": plan["rollout_batch"],
            "grad_ckpt": int(plan["gradient_checkpointing"])}


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


def kv_cache_argument(parser: argparse.ArgumentParser) -> None:
    """--kv-cache: the rollout's KV cache format (engine.kv_cache), a setting of the row."""
    from qerl.formats.kv_cache import DEFAULT, KV_CACHES

    parser.add_argument("--kv-cache", choices=KV_CACHES, default=DEFAULT,
                        help="the rollout engine's KV cache (engine.kv_cache)")


def step_arguments(parser: argparse.ArgumentParser, prompts: int) -> None:
    """The options naming the steps measured or modelled (``qerl bench step`` and
    ``footprint``): where the CSV goes, the models, the methods, P x G x L and the rank."""
    parser.add_argument("--out-dir", type=Path, default=Path("results/bench"))
    parser.add_argument("--archs", default="qwen2.5-7b",
                        help="architectures, with random weights")
    parser.add_argument("--methods", default=",".join(LORA_METHODS))
    parser.add_argument("--prompts", type=int, default=prompts, help="P: prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="G: completions each")
    parser.add_argument("--completion", type=int, default=2048, help="L: tokens each")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="qerl bench step", description=__doc__,
                                     formatter_class=HelpFormatter)
    step_arguments(parser, prompts=4)
    parser.add_argument("--model", help="instead of --archs: one model (directory, hub id, "
                                        ".gguf or smollm2-135m-instruct) with its tokenizer")
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="rl.max_prompt_length (a longer prompt is left out)")
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="completions per forward/backward")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    parser.add_argument("--memory-gb", type=float,
                        help="fit each step into this much GPU memory (qerl.rl.budget)")
    kv_cache_argument(parser)
    parser.add_argument("--gpus", default="0",
                        help="GPUs to spread the (model, method) processes over, e.g. 0,1,2,3")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--busy", default="0",
                        help="CPU: measure beside N busy processes, for each N listed "
                             "(e.g. 0,1)")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if (args.prompts * args.generations) % args.micro_batch:
        parser.error("--micro-batch must divide prompts x generations")
    busy = [int(n) for n in args.busy.split(",") if n.isdigit()]
    if len(busy) != len(args.busy.split(",")) or (args.device != "cpu" and any(busy)):
        parser.error(f"--busy takes counts of processes (e.g. 0,1), on a CPU; got {args.busy!r}")

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
    if args.device == "cpu":
        base["cores"] = os.cpu_count()
    path = args.out_dir / per_card("efficiency", base["card"])
    settings = {"lora_rank": args.rank, "prompts": args.prompts,
                "generations": args.generations, "completion": args.completion,
                "micro_batch": args.micro_batch, "grad_ckpt": int(args.grad_ckpt),
                "kv_cache": args.kv_cache,
                **({"memory_gb": args.memory_gb} if args.memory_gb else {})}
    own = list(argv if argv is not None else sys.argv[1:])
    free = queue.Queue()
    for env in gpu_env(gpus):
        free.put(env)

    def child(model: str, method: str, neighbours: int) -> dict:
        env = free.get()
        try:
            with busy_processes(neighbours):
                done = subprocess.run([sys.executable, "-m", "qerl.bench.step", *own,
                                       "--gpus", "0", "--child", model, method],
                                      capture_output=True, text=True, env=env)
        finally:
            free.put(env)
        result = child_result(done)
        return {**base, "model": model, "method": method, **settings,
                **({"busy": neighbours} if args.device == "cpu" else {}),
                **{key: result.get(key) for key in RESULT},
                **{key: result[key] for key in PLANNED if key in result}}

    models = [args.model] if args.model else args.archs.split(",")
    jobs = [(model, method, n) for n in busy for model in models
            for method in args.methods.split(",")]
    with ThreadPoolExecutor(max_workers=len(gpus)) as pool:
        for future in as_completed([pool.submit(child, *job) for job in jobs]):
            row = future.result()
            print(json.dumps(row), flush=True)
            append_rows(path, [row])
    print(summary("step", path))
    print(path)


def child_result(done: subprocess.CompletedProcess) -> dict:
    """A measuring process's row (its output's last line, JSON), or 'failed' and the end of
    what it printed on stderr."""
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"status": "failed", "error": done.stderr.strip()[-500:]}


@contextmanager
def busy_processes(count: int):
    """``count`` processes that each keep one core busy until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()

if __name__ == "__main__":
    main()
