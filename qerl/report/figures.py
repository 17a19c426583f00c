"""Figures: reward and entropy curves per run, rollout throughput by LoRA rank, kernel
speed-ups."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def curves(values: pd.DataFrame, out: Path) -> list[Path]:
    """One figure per (model, recipe): reward and entropy by step, a line per method."""
    train = values[(values.kind == "train") & values.metric.isin(["reward", "entropy"])].copy()
    if train.empty:
        return []
    plt = _pyplot()
    train["step"] = train.bench.str.removeprefix("step").astype(int)
    written = []
    for (model, recipe), runs in train.groupby(["model", "recipe"]):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for ax, metric in zip(axes, ["reward", "entropy"], strict=True):
            for method, run in runs[runs.metric == metric].groupby("method"):
                run = run.sort_values("step")
                ax.plot(run.step, run.value, marker="o", label=method)
            ax.set(xlabel="step", ylabel=metric, title=f"{model} {recipe}: {metric}")
            ax.legend()
        fig.tight_layout()
        path = out / f"curves_{model}_{recipe}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


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
    fig.tight_layout()
    path = out / "rollout_by_rank.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


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
    fig.tight_layout()
    path = out / "kernel_speedups.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def science_curves(values: pd.DataFrame, out: Path) -> list[Path]:
    """Reward and entropy by step for each variant of the study: mean over seeds, with a
    band of one standard deviation."""
    runs = values[(values.kind == "science") & values.bench.str.startswith("step")].copy()
    if runs.empty:
        return []
    plt = _pyplot()
    runs["step"] = runs.bench.str.removeprefix("step").astype(int)
    written = []
    for model, group in runs.groupby("model"):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for ax, metric in zip(axes, ["reward", "entropy"], strict=True):
            for variant, part in group[group.metric == metric].groupby("recipe"):
                stats = part.groupby("step").value.agg(["mean", "std", "count"])
                ax.plot(stats.index, stats["mean"], label=f"{variant} ({stats['count'].max()})")
                ax.fill_between(stats.index, stats["mean"] - stats["std"].fillna(0),
                                stats["mean"] + stats["std"].fillna(0), alpha=0.2)
            ax.set(xlabel="step", ylabel=metric, title=f"{model}: {metric} (mean +- std)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"science_{model}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


FIGURES = (curves, throughput_by_rank, kernel_speedups, science_curves)
