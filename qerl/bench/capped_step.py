"""RL steps under a hard memory cap on one GPU, beside the same steps on the whole card:
which model fits which card. For each model x budget x method the step is planned into the
budget (qerl.rl.budget) and trained, with torch capped to it, as `qerl bench step` trains
(random weights at the real shapes, P prompts x G completions of L tokens); its peak is
measured as the driver sees it (NVML) and as torch does. Each (model, method) also runs
planned for the whole card (its memory, less the same allowance), in the same run: the
time the capped steps are compared with (``time_vs_uncapped``). Where one call cannot hold
both (a GPU lent by the job, a 72B step), ``--whole-card only`` measures the whole card's
step alone, and a later ``--whole-card earlier`` compares its capped steps with the newest
whole-card step of the same card, model, method and settings in the CSV (its run named in
``uncapped_run``).

    qerl bench budget                       # Qwen2.5 7B-72B x 8/16/32/56 GB x lora, qlora, qerl
    qerl bench budget --archs qwen2.5-7b --memory-gb 8,16 --methods qerl --completion 512
    qerl bench budget --kernel-arch sm_89   # the kernels an RTX 4090 runs (QERL_KERNEL_ARCH)
    qerl bench budget --gpus 0,1,2,3        # (model, method) pairs spread over four GPUs
    qerl bench budget --archs qwen2.5-72b --memory-gb 56 --whole-card only   # then:
    qerl bench budget --archs qwen2.5-72b --memory-gb 56 --whole-card earlier

A row's status: ok (ran, and the driver's peak stayed within the budget), over (ran within
torch's cap, but the driver's peak passed the budget: more than the context allowance was
held outside torch), oom (torch's cap was reached), refused (the plan does not fit:
needs_gb is the smallest budget that would; nothing ran), failed (error says why).
nvml_peak_gb is the GPU's memory in use at its highest less what was in use before the
measuring process started (driver_memory; each GPU is held whole), so nvml_peak_gb -
torch_reserved_gb measures the CUDA context allowance the plan assumes
(qerl.rl.budget.CUDA_CONTEXT_GB), and torch_reserved_gb - torch_peak_gb the allocator's
slack. The KV cache is BF16 or, with --kv-cache fp8, E4M3 with its scales (kv_cache): a
user's choice the plan takes as given. ``measures`` names what the plan took beyond its
batch sizes (qerl.rl.budget.MEASURES: the input embedding or the optimizer's state in the
host's memory, the KV cache freed while training), "+"-joined, or none.

Rows go to results/bench/budget_<card>.csv as each (model, method) finishes; `qerl report`
tabulates them: budget.md (every row) and fits.md (which model fits which budget).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed

from qerl.bench.step import child_result, kv_cache_argument, measure, step_arguments
from qerl.errors import QuantizationError
from qerl.help_format import HelpFormatter
from qerl.methods import LORA_METHODS

ARCHS = ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b")
BUDGETS = "8,16,32,56"
# What makes two rows' steps the same step (beside card, model and method).
SETTINGS = ("lora_rank", "prompts", "generations", "completion", "prompt_tokens", "kernel_arch",
            "kv_cache")
MEASURED = ("status", "steps_measured", "step_s", "nvml_peak_gb", "torch_peak_gb",
            "torch_reserved_gb", "error")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="qerl bench budget", description=__doc__,
                                     formatter_class=HelpFormatter)
    step_arguments(parser, prompts=1)
    parser.set_defaults(archs=",".join(ARCHS), model=None, device="cuda", grad_ckpt=True)
    parser.add_argument("--memory-gb", dest="budgets", default=BUDGETS,
                        help="the budgets (GB, as the driver counts them)")
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="rl.max_prompt_length (a longer prompt is left out)")
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="the most completions a forward/backward (the plan may take "
                             "fewer)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gpus", default="0", help="GPUs to spread the (model, method) "
                                                    "pairs over, e.g. 0,1,2,3")
    parser.add_argument("--kernel-arch", help="choose the kernels as on this older "
                                              "architecture (e.g. sm_89, sm_80)")
    kv_cache_argument(parser)
    parser.add_argument("--whole-card", choices=("also", "only", "earlier"), default="also",
                        help="the whole card's step: measured in this run beside the "
                             "budgets', alone, or taken from an earlier run in the CSV")
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "METHOD", "GB", "UUID"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.budget_list = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        parser.error(f"--memory-gb takes budgets in GB, e.g. 8,16; got {args.budgets!r}")
    if min(args.budget_list) <= 0:
        parser.error("--memory-gb: a budget must be positive")
    unknown = set(args.methods.split(",")) - set(LORA_METHODS)
    if unknown:
        parser.error(f"--methods: a budget plans {', '.join(LORA_METHODS)}; not "
                     f"{', '.join(sorted(unknown))}")
    return args


def planned(args: argparse.Namespace, model: str, method: str, budget_gb: float):
    """The plan of one step (qerl.rl.budget.Plan), or its refusal (DoesNotFit)."""
    from qerl.archs import config_for
    from qerl.rl.budget import DoesNotFit, plan_step

    try:
        return plan_step(config_for(model), budget_gb=budget_gb, method=method,
                         completions=args.prompts * args.generations,
                         max_micro_batch=args.micro_batch, prompt_len=args.prompt_tokens,
                         completion=args.completion, rank=args.rank, kv_cache=args.kv_cache)
    except DoesNotFit as refused:
        return refused


def budgets_to_run(args: argparse.Namespace, model: str, method: str,
                   card_gb: float) -> list[float]:
    """The budgets one (model, method) runs at, the whole card's first: the step a capped
    one is compared with, measured only where some budget's plan fits (a refusal runs
    nothing, so it needs no comparison), and as ``--whole-card`` says."""
    fits = any(not isinstance(planned(args, model, method, b), Exception)
               for b in args.budget_list)
    whole = [card_gb] if fits and args.whole_card != "earlier" else []
    return whole if args.whole_card == "only" else [*whole, *args.budget_list]


def earlier_whole_card(path, prefix: dict) -> dict | None:
    """The newest whole-card row in the CSV at ``path`` that ran (status ok) with the card,
    model, method and settings of ``prefix``, or None."""
    import pandas as pd

    if not path.is_file():
        return None
    frame = pd.read_csv(path)
    same = frame[(frame.whole_card == 1) & (frame.status == "ok")]
    for key in ("card", "model", "method", *SETTINGS):
        if key not in same:  # rows from before the setting was recorded: not the same step
            return None
        same = same[same[key] == prefix[key]]
    return None if same.empty else same.iloc[-1].to_dict()


def measure_capped(args: argparse.Namespace, model: str, method: str, budget_gb: float,
                   uuid: str) -> dict:
    """In this process, alone on the GPU ``uuid``: the step trained within ``budget_gb``,
    its step time and its peaks as the driver and torch see them."""
    from qerl.bench.driver_memory import DriverPeak

    args.memory_gb = budget_gb
    with DriverPeak(uuid) as driver:
        row = measure(args, model, method)
    # torch's: the most a step allocated and reserved (the trainer logs them each step).
    return {**row, "nvml_peak_gb": round(driver.peak_gb, 2),
            "torch_peak_gb": row.get("peak_gb"), "torch_reserved_gb": row.get("reserved_gb")}


def verdict(row: dict, budget_gb: float) -> str:
    """ok, or over where a step that ran passed its budget as the driver counts it."""
    if row.get("status") == "ok" and (row.get("nvml_peak_gb") or 0) > budget_gb:
        return "over"
    return row.get("status") or "failed"


def pair_rows(prefix: dict, card_gb: float, measured: list[tuple[float, dict]],
              earlier: dict | None = None) -> list[dict]:
    """The rows of one (model, method) from ``measured``, (budget, result) pairs, the whole
    card's first: each with its verdict and its time against the whole card's step, this
    run's or else ``earlier``'s (a row of an earlier run)."""
    rows = [{**prefix, "memory_gb": budget_gb, "whole_card": int(budget_gb == card_gb),
             **{k: result.get(k) for k in ("needs_gb", "rollout_batch", "micro_batch",
                                           "measures", *MEASURED)},
             "status": verdict(result, budget_gb)} for budget_gb, result in measured]
    whole = rows[0] if rows and rows[0]["whole_card"] else earlier
    uncapped = whole["step_s"] if whole and whole["status"] == "ok" else None
    for row in rows:
        row["uncapped_step_s"] = uncapped
        row["uncapped_run"] = whole.get("run") if uncapped else None
        row["time_vs_uncapped"] = (round(row["step_s"] / uncapped, 3)
                                   if uncapped and row["step_s"] else None)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.child:
        model, method, budget_gb, uuid = args.child
        print(json.dumps(measure_capped(args, model, method, float(budget_gb), uuid)))
        return

    import torch

    from qerl.kernels import compute_capability
    from qerl.record import append_rows, per_card, provenance
    from qerl.report.run import summary
    from qerl.rl.budget import CUDA_CONTEXT_GB, measures_label

    if not torch.cuda.is_available():
        raise SystemExit("qerl bench budget: needs a CUDA GPU (none found)")
    gpus = args.gpus.split(",")
    if any(not g.isdigit() or int(g) >= torch.cuda.device_count() for g in gpus):
        raise SystemExit(f"qerl bench budget: --gpus {args.gpus}, but "
                         f"{torch.cuda.device_count()} GPU(s) are visible")
    props = [torch.cuda.get_device_properties(int(g)) for g in gpus]
    if len({p.name for p in props}) > 1:
        raise SystemExit(f"qerl bench budget: --gpus mixes card models "
                         f"{sorted({p.name for p in props})}; a row names one")
    if args.kernel_arch:
        os.environ[compute_capability.VARIABLE] = args.kernel_arch  # the children's too
    try:
        arch = compute_capability.chosen_for(torch.device("cuda", int(gpus[0])))
    except QuantizationError as e:  # a bad or newer architecture, named
        raise SystemExit(f"qerl bench budget: --kernel-arch: {e}") from e
    card_gb = math.floor(props[0].total_memory / 1e8) / 10  # within the card: enforceable
    base = provenance("cuda")
    path = args.out_dir / per_card("budget", base["card"])
    settings = {"lora_rank": args.rank, "prompts": args.prompts,
                "generations": args.generations, "completion": args.completion,
                "prompt_tokens": args.prompt_tokens, "kernel_arch": f"sm_{arch}",
                "kv_cache": args.kv_cache, "context_gb": CUDA_CONTEXT_GB}
    own = list(argv if argv is not None else sys.argv[1:])
    # A child sees its GPU by UUID, which NVML also reads it by (CUDA's and NVML's
    # numbering may differ).
    free = queue.Queue()
    for p in props:
        free.put(f"GPU-{p.uuid}")

    def run(model: str, method: str, budget_gb: float) -> dict:
        plan = planned(args, model, method, budget_gb)
        if isinstance(plan, Exception):
            return {"status": "refused", "needs_gb": plan.needs_gb, "error": str(plan)}
        uuid = free.get()
        try:
            done = subprocess.run([sys.executable, "-m", "qerl.bench.capped_step", *own,
                                   "--child", model, method, str(budget_gb), uuid],
                                  capture_output=True, text=True,
                                  env={**os.environ, "CUDA_VISIBLE_DEVICES": uuid})
        finally:
            free.put(uuid)
        return {**child_result(done), "needs_gb": round(plan.needs_gb, 2),
                "rollout_batch": plan.rollout_batch, "micro_batch": plan.micro_batch,
                "measures": measures_label(plan.measures)}

    def pair(model: str, method: str) -> list[dict]:
        prefix = {**base, "model": model, "method": method, **settings}
        earlier = None
        if args.whole_card == "earlier":
            earlier = earlier_whole_card(path, prefix)
            if earlier is None:
                print(f"qerl bench budget: no whole-card step of {model} {method} with these "
                      f"settings in {path}: its capped steps' time_vs_uncapped left empty")
        return pair_rows(prefix, card_gb, [(b, run(model, method, b))
                                           for b in budgets_to_run(args, model, method, card_gb)],
                         earlier)

    jobs = [(m, method) for m in args.archs.split(",") for method in args.methods.split(",")]
    with ThreadPoolExecutor(max_workers=len(gpus)) as pool:
        for future in as_completed([pool.submit(pair, *job) for job in jobs]):
            rows = future.result()
            for row in rows:
                print(json.dumps(row), flush=True)
            append_rows(path, rows)
    print(summary("budget", path))
    print(path)


if __name__ == "__main__":
    main()
