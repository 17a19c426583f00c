"""Tables of reproduced numbers with the paper's beside them (markdown and CSV)."""

from __future__ import annotations

import pandas as pd

PAPER_METRIC = {"gsm8k": "gsm8k_accuracy", "math500": "math500_accuracy"}
# Our rollout weights -> the paper's method for the same rollout (LoRA on a BF16 base, or
# qerl on NVFP4).
ROLLOUT_METHOD = {"bf16": "lora", "nvfp4": "qerl"}


def paper_model(model: str) -> str:
    """'qwen2.5-7b-instruct' and 'qwen2.5-7b' both name the paper's Qwen2.5-7B-Instruct."""
    return model.lower().removesuffix("-instruct")


def accuracy(values: pd.DataFrame, paper: pd.DataFrame) -> pd.DataFrame:
    """pass@1 (%) of every trained policy and base model, the paper's accuracy beside it."""
    ours = values[(values.kind == "eval") & (values.metric == "pass@1")]
    if ours.empty:
        return pd.DataFrame()
    table = ours.assign(reproduced=ours.value * 100)[
        ["model", "recipe", "method", "bench", "reproduced"]]
    ref = paper[paper.metric.isin(PAPER_METRIC.values())]
    lookup = {(paper_model(r.model), r.method, r.metric): r.value for r in ref.itertuples()}
    table["paper"] = [lookup.get((paper_model(r.model), r.method, PAPER_METRIC.get(r.bench)))
                      for r in table.itertuples()]
    table["delta"] = table.reproduced - table.paper
    return table.reset_index(drop=True)


def rollout(values: pd.DataFrame, paper: pd.DataFrame) -> pd.DataFrame:
    """Rollout tokens/s, NVFP4 against BF16 in the same run, with the paper's ratio (qerl
    over LoRA at the same LoRA rank, where it gives one)."""
    ours = values[(values.kind == "rollout") & values.method.isin(ROLLOUT_METHOD)]
    if ours.empty:
        return pd.DataFrame()
    wide = ours.pivot_table(index=["recipe", "model", "bench"], columns="method",
                            values="value").reset_index().rename(columns={"recipe": "card"})
    if not {"bf16", "nvfp4"} <= set(wide.columns):
        return wide
    wide["nvfp4/bf16"] = wide.nvfp4 / wide.bf16
    ref = paper[paper.metric == "rollout_throughput"]
    by = {(paper_model(r.model), r.method, r.lora_rank): r.value for r in ref.itertuples()}
    # The paper's 7B numbers name no rank (its default, r32).
    unranked = {(paper_model(r.model), r.method): r.value for r in ref.itertuples()
                if pd.isna(r.lora_rank)}
    ratios = []
    for r in wide.itertuples():
        rank = float(r.bench.split("-")[0].removeprefix("r"))
        model = paper_model(r.model)
        qerl = by.get((model, "qerl", rank), unranked.get((model, "qerl")))
        lora = by.get((model, "lora", rank), unranked.get((model, "lora")))
        ratios.append(qerl / lora if qerl and lora else None)
    wide["paper qerl/lora"] = ratios
    return wide.rename(columns={"bench": "rank-batch-prompt"})


def training(values: pd.DataFrame, paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """One line per run: steps, last reward and entropy, mean step time, peak memory."""
    ours = values[values.kind == "train"].copy()
    if ours.empty:
        return pd.DataFrame()
    ours["step"] = ours.bench.str.removeprefix("step").astype(int)
    rows = []
    for (model, recipe, method), run in ours.groupby(["model", "recipe", "method"]):
        last = run[run.step == run.step.max()].set_index("metric").value
        mean = run.groupby("metric").value.mean()
        rows.append({"model": model, "recipe": recipe, "method": method,
                     "steps": run.step.max(), "reward (last)": last.get("reward"),
                     "entropy (last)": last.get("entropy"),
                     "step time (s, mean)": mean.get("step_time"),
                     "peak GB": run[run.metric == "memory/peak_gb"].value.max()})
    return pd.DataFrame(rows)


def kernels(values: pd.DataFrame, paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """NVFP4 matmul speed-up over cuBLAS BF16, by model, layer, op and M."""
    ours = values[values.kind == "kernels"]
    if ours.empty:
        return pd.DataFrame()
    return ours.rename(columns={"recipe": "card", "method": "op", "bench": "layer-M",
                                "value": "speedup"})[["card", "model", "op", "layer-M",
                                                      "speedup"]].reset_index(drop=True)


def efficiency(values: pd.DataFrame, paper: pd.DataFrame) -> pd.DataFrame:
    """One RL step per model and method: time, peak memory, speed against LoRA in the same
    run, and the paper's end-to-end speed against LoRA."""
    ours = values[values.kind == "step"]
    if ours.empty:
        return pd.DataFrame()
    wide = ours.pivot_table(index=["recipe", "model", "bench", "method"], columns="metric",
                            values="value").reset_index().rename(
        columns={"recipe": "card", "bench": "setting"})
    wide = wide.rename(columns={"speed_vs_lora": "speed vs lora"})
    if "speed vs lora" not in wide:
        wide["speed vs lora"] = None
    ref = paper[paper.metric == "end_to_end_speed"]
    speed = {(paper_model(r.model), r.method): r.value for r in ref.itertuples()}
    wide["paper speed vs lora"] = [speed.get((paper_model(r.model), r.method))
                                   for r in wide.itertuples()]
    return wide


def science(values: pd.DataFrame, paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per variant of the study, over its seeds (mean and standard deviation): reward over
    the first and the last quarter of the steps and their difference (the growth), mean
    entropy over the steps, and each held-out benchmark's avg@k (with how many seeds)."""
    ours = values[values.kind == "science"]
    if ours.empty:
        return pd.DataFrame()
    rows = []
    for (model, variant), runs in ours.groupby(["model", "recipe"]):
        steps = runs[runs.bench.str.startswith("step")].copy()
        steps["step"] = steps.bench.str.removeprefix("step").astype(int)
        last = steps.step.max()
        reward = steps[steps.metric == "reward"]
        per_seed = pd.DataFrame({
            "reward (first quarter)": reward[reward.step <= 0.25 * last]
            .groupby("method").value.mean(),
            "reward (last quarter)": reward[reward.step > 0.75 * last]
            .groupby("method").value.mean(),
            "entropy (mean)": steps[steps.metric == "entropy"].groupby("method").value.mean(),
        })
        per_seed["reward growth"] = (per_seed["reward (last quarter)"]
                                     - per_seed["reward (first quarter)"])
        row = {"model": model, "variant": variant, "seeds": len(per_seed), "steps": last}
        for name in ("reward (first quarter)", "reward (last quarter)", "reward growth",
                     "entropy (mean)"):
            row[f"{name} mean"] = per_seed[name].mean()
            row[f"{name} std"] = per_seed[name].std()
        held_out = runs[runs.bench.str.startswith("held-out")
                        & runs.metric.str.startswith("avg@")]
        for (bench, metric), part in held_out.groupby(["bench", "metric"]):
            name = f"{bench.removeprefix('held-out-')} {metric}"
            row[f"{name} mean"] = part.value.mean()
            row[f"{name} std"] = part.value.std()
            row[f"{name} seeds"] = len(part)
        rows.append(row)
    return pd.DataFrame(rows)


TABLES = {"accuracy": accuracy, "rollout": rollout, "training": training, "kernels": kernels,
          "efficiency": efficiency, "science": science}
