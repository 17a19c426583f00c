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
left out of the medians); the table beside it, rewritten from the whole file, gives each
method's step time against LoRA's at the same model and settings measured within an hour of
it (the same run or back to back on one machine), and the paper's end-to-end speed beside it
where it gives one.
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

PHASES = ("rollout", "score", "train", "optimizer")
METHODS = ("lora", "qlora", "qerl")
RESULT = ("status", "steps_measured", *(f"{p}_s" for p in PHASES), "step_s",
          "rollout_tok_per_s", "peak_gb", "error")
SETTINGS = ("lora_rank", "prompts", "generations", "completion", "micro_batch", "grad_ckpt")


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


def _order(column):
    """Sort keys: models by size (the number in the name), methods as in METHODS."""
    if column.name in ("completion", "prompts"):
        return column
    if column.name == "method":
        return column.map(lambda m: METHODS.index(m) if m in METHODS else len(METHODS))
    return column.str.extract(r"(\d+(?:\.\d+)?)b", expand=False).astype(float).fillna(0)


# A ratio pairs a row with the LoRA row measured within this time of it: one run, or runs
# back to back on one machine, so that no ratio mixes code versions or machines.
PAIR_WINDOW_HOURS = 1.0


def compare(frame):
    """The newest row of each (model, method, settings), with its speed against LoRA's at
    the same model and settings (measured within PAIR_WINDOW_HOURS of it, where the rows
    are dated) and the paper's end-to-end speed."""
    import pandas as pd

    from qerl.report.run import PAPER
    from qerl.report.tables import paper_model

    frame = frame.drop_duplicates(["model", "method", *SETTINGS], keep="last")
    frame = frame.sort_values(["completion", "prompts", "model", "method"], key=_order,
                              kind="stable")
    group = ["model", *SETTINGS]
    lora = frame[frame.method == "lora"].set_index(group)
    dated = "date" in frame
    window = pd.Timedelta(hours=PAIR_WINDOW_HOURS)

    def speed(row) -> float | None:
        key = tuple(row[g] for g in group)
        if key not in lora.index or not row["step_s"] or pd.isna(lora.loc[key, "step_s"]):
            return None
        if dated and abs(pd.Timestamp(lora.loc[key, "date"]) - pd.Timestamp(row["date"])) \
                > window:
            return None
        return lora.loc[key, "step_s"] / row["step_s"]

    frame = frame.assign(**{"speed vs lora": [speed(row) for _, row in frame.iterrows()]})
    paper = pd.read_csv(PAPER)
    paper = paper[paper.metric == "end_to_end_speed"]
    speed_paper = {(paper_model(m), method): v for m, method, v
                   in zip(paper.model, paper.method, paper.value, strict=True)}
    frame["paper speed vs lora"] = [speed_paper.get((m, method)) for m, method
                                    in zip(frame.model, frame.method, strict=True)]
    return frame


def table(frame) -> str:
    """Markdown: each method's step and phase times against LoRA's (see ``compare``)."""
    frame = compare(frame)
    columns = ["date", "model", "method", "prompts", "generations", "completion",
               "micro_batch", "grad_ckpt", "status", *[f"{p}_s" for p in PHASES], "step_s",
               "speed vs lora", "paper speed vs lora", "rollout_tok_per_s", "peak_gb"]
    return frame[[c for c in columns if c in frame]].to_markdown(index=False, floatfmt=".3g")


def figure(frame, path: Path, card: str) -> None:
    """Per settings: each (model, method)'s step time stacked by phase with its speed against
    LoRA (the paper's in brackets), and its peak GPU memory against an 80 GB card (runs out
    of memory drawn at the peak they reached)."""
    import matplotlib
    import pandas as pd

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = compare(frame)
    groups = list(frame.groupby(list(SETTINGS), sort=False))
    fig, axes = plt.subplots(2, len(groups), figsize=(1.1 * len(frame) + 3, 6.5),
                             squeeze=False, sharey="row")
    for col, (settings, rows) in enumerate(groups):
        labels = [f"{m.removeprefix('qwen2.5-')}\n{method}"
                  for m, method in zip(rows.model, rows.method, strict=True)]
        bottom = 0
        for phase in PHASES:
            values = rows[f"{phase}_s"].fillna(0).to_numpy()
            axes[0][col].bar(labels, values, bottom=bottom, label=phase)
            bottom = bottom + values
        for x, (top, ours, theirs) in enumerate(zip(
                bottom, rows["speed vs lora"], rows["paper speed vs lora"], strict=True)):
            if pd.notna(ours):
                text = f"{ours:.2f}x" + (f"\n({theirs:.1f}x)" if pd.notna(theirs) else "")
                axes[0][col].annotate(text, (x, top), ha="center", va="bottom", fontsize=6)
        setting = dict(zip(SETTINGS, settings, strict=True))
        axes[0][col].set_title(f"P={setting['prompts']} G={setting['generations']} "
                               f"L={setting['completion']}"
                               + (" grad-ckpt" if setting["grad_ckpt"] else ""), fontsize=9)
        colours = ["C3" if s == "oom" else "C7" for s in rows.status]
        axes[1][col].bar(labels, rows.peak_gb.fillna(0), color=colours)
        axes[1][col].axhline(80, color="k", ls=":", lw=1)
        for ax in axes[:, col]:
            ax.tick_params(axis="x", labelsize=7)
    axes[0][0].set_ylabel("step time (s)")
    axes[0][0].legend(fontsize=7)
    axes[1][0].set_ylabel("peak GPU memory (GB)\nred: out of memory")
    fig.suptitle(f"One RL step, {card}")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def write_table(path: Path) -> Path:
    """The markdown table and the figure beside the CSV at ``path``, from all its rows."""
    import pandas as pd

    card = path.stem.removeprefix("efficiency_").replace("_", " ")
    figure(pd.read_csv(path), path, card)
    out = path.with_suffix(".md")
    out.write_text(f"# qerl bench step, {card}\n\n"
                   "P prompts x G completions of L (`completion`) tokens per step; "
                   "`step_s` is the sum of the phases (median over the steps after the "
                   "first); speed vs lora compares rows of one model and settings "
                   "measured within an hour of each other (the same run, or back to back "
                   "on one machine); rows without a LoRA row that close show none.\n\n"
                   + table(pd.read_csv(path)) + "\n")
    return out


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

    from qerl.bench.record import append_rows, provenance

    base = provenance(args.device)
    card = base["card"].replace(" ", "_")
    path = args.out_dir / f"efficiency_{card}.csv"
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
    write_table(path)
    print(path)

if __name__ == "__main__":
    main()
