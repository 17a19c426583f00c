"""Figures: reward and entropy curves per run, rollout throughput by LoRA rank, kernel
speed-ups."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

SMOOTH = 10  # steps in the running mean of the study's curves


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _by_step(frame: pd.DataFrame, draw, title: str, path: Path) -> Path:
    """Reward and entropy side by side against the step; ``draw(ax, rows)`` plots one
    metric's rows."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, metric in zip(axes, ["reward", "entropy"], strict=True):
        draw(ax, frame[frame.metric == metric])
        ax.set(xlabel="step", ylabel=metric, title=metric)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(plt, fig, path)


def _steps(values: pd.DataFrame, kind: str) -> pd.DataFrame:
    rows = values[(values.kind == kind) & values.bench.str.startswith("step")
                  & values.metric.isin(["reward", "entropy"])].copy()
    rows["step"] = rows.bench.str.removeprefix("step").astype(int)
    return rows


def curves(values: pd.DataFrame, out: Path) -> list[Path]:
    """One figure per (model, recipe): reward and entropy by step, a line per method."""

    def draw(ax, rows):
        for method, run in rows.groupby("method"):
            run = run.sort_values("step")
            ax.plot(run.step, run.value, marker="o", label=method)

    return [_by_step(runs, draw, f"{model} {recipe}", out / f"curves_{model}_{recipe}.png")
            for (model, recipe), runs in _steps(values, "train").groupby(["model", "recipe"])]


def throughput_by_rank(values: pd.DataFrame, out: Path) -> list[Path]:
    rollout = values[values.kind == "rollout"].copy()
    if rollout.empty:
        return []
    plt = _pyplot()
    parts = rollout.bench.str.extract(r"r(?P<rank>\d+)-b(?P<batch>\d+)-p(?P<prompt>\d+)")
    rollout = rollout.join(parts.astype(int))
    fig, ax = plt.subplots(figsize=(6, 4))
    for (model, weights, batch), group in rollout.groupby(["model", "method", "batch"]):
        group = group.groupby("rank").value.mean()
        if len(group) > 1:
            ax.plot(group.index, group.values, marker="o", label=f"{model} {weights} b{batch}")
    ax.set(xlabel="LoRA rank", ylabel="tokens/s", title="rollout throughput by LoRA rank")
    ax.legend(fontsize=6)
    return [_save(plt, fig, out / "rollout_by_rank.png")]


def kernel_speedups(values: pd.DataFrame, out: Path) -> list[Path]:
    kernels = values[(values.kind == "kernels") & (values.method == "fwd")].copy()
    if kernels.empty:
        return []
    plt = _pyplot()
    parts = kernels.bench.str.extract(r"(?P<layer>.+)-M(?P<m>\d+)")
    kernels = kernels.join(parts)
    kernels["m"] = kernels.m.astype(int)
    fig, ax = plt.subplots(figsize=(6, 4))
    for (model, layer), group in kernels.groupby(["model", "layer"]):
        group = group.sort_values("m")
        ax.plot(group.m, group.value, marker="o", label=f"{model} {layer}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="M (tokens)", ylabel="speed-up vs cuBLAS BF16",
           title="NVFP4 matmul")
    ax.legend(fontsize=6)
    return [_save(plt, fig, out / "kernel_speedups.png")]


def science_curves(values: pd.DataFrame, out: Path) -> list[Path]:
    """Reward and entropy by step for each variant of the study: mean over seeds, with a
    band of one standard deviation, both as running means over SMOOTH steps (one step's
    reward is a mean over a few dozen completions: too noisy to read)."""

    def draw(ax, rows):
        for variant, part in rows.groupby("recipe"):
            stats = part.groupby("step").value.agg(["mean", "std", "count"])
            stats[["mean", "std"]] = stats[["mean", "std"]].rolling(SMOOTH, min_periods=1
                                                                    ).mean()
            spread = stats["std"].fillna(0)
            ax.plot(stats.index, stats["mean"], label=f"{variant} ({stats['count'].max()})")
            ax.fill_between(stats.index, stats["mean"] - spread, stats["mean"] + spread,
                            alpha=0.2)

    return [_by_step(runs, draw, f"{model}: mean +- std over seeds (in brackets), "
                     f"{SMOOTH}-step running mean", out / f"science_{model}.png")
            for model, runs in _steps(values, "science").groupby("model")]


FIGURES = (curves, throughput_by_rank, kernel_speedups, science_curves)
