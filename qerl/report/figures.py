"""Figures, one per concept (and per card, where the figure is of a card's measurements):
reward and entropy per run and per study, entropy by weight format, rollout throughput by
LoRA rank (the paper's figure) and NVFP4's rollout speed-up by batch, kernel speed-ups by
M, and one RL step by phase with its memory. Each takes the frames ``collect`` read and the
paper's numbers and returns the files it wrote."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from qerl.record import per_card
from qerl.report.collect import MISMATCH, different_runs, step_settings
from qerl.report.tables import ROLLOUT_METHOD, cache_label, efficiency, paper_model, rollout
from qerl.rl.phases import PHASES

SMOOTH = 10  # steps in the running mean of the study's curves


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _by_step(frame: pd.DataFrame, draw, title: str, path: Path,
             metrics: tuple[str, ...] = ("reward", "entropy")) -> Path:
    """``metrics`` side by side against the step (whole steps on the axis);
    ``draw(ax, frame, metric)`` plots one."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8))
    for ax, metric in zip(axes, metrics, strict=True):
        draw(ax, frame, metric)
        ax.set(xlabel="step", ylabel=metric, title=metric)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(plt, fig, path)


MARKERS, DASHES = "osD^v", ("-", "--", ":", "-.")


def _overlaid(i: int) -> dict:
    """The style of the i-th line of a plot whose lines may coincide (methods that learned
    nothing in a short run log the same values): each its own marker and dash, and each
    drawn smaller than the one before, so that one on top of another leaves it visible."""
    return {"marker": MARKERS[i % len(MARKERS)], "linestyle": DASHES[i % len(DASHES)],
            "markersize": max(3.0, 9.0 - 1.5 * i), "markerfacecolor": "none",
            "linewidth": max(1.0, 2.5 - 0.4 * i)}


def curves(frames: dict, paper: pd.DataFrame, out: Path) -> list[Path]:
    """One figure per (model, recipe) of `qerl train` runs: reward and entropy by step, a
    line per method, and the sampler/trainer mismatch where the runs logged it (runs on
    each rollout backend side by side)."""
    runs = frames.get("train")
    if runs is None:
        return []

    def draw(ax, frame, metric):
        for i, (method, run) in enumerate(frame.groupby("method")):
            if metric in run:
                run = run.sort_values("step")
                ax.plot(run.step, run[metric], label=method, **_overlaid(i))

    def metrics(group):
        logged = MISMATCH in group and group[MISMATCH].notna().any()
        return ("reward", "entropy", MISMATCH) if logged else ("reward", "entropy")

    return [_by_step(group, draw, f"{model} {recipe}", out / f"curves_{model}_{recipe}.png",
                     metrics(group))
            for (model, recipe), group in runs.groupby(["model", "recipe"])]


def science_curves(frames: dict, paper: pd.DataFrame, out: Path) -> list[Path]:
    """Reward and entropy by step for each variant of the study: mean over seeds, with a
    band of one standard deviation, both as running means over SMOOTH steps (one step's
    reward is a mean over a few dozen completions: too noisy to read)."""
    runs = frames.get("science")
    if runs is None:
        return []

    def draw(ax, frame, metric):
        from matplotlib import colormaps

        variants = frame.groupby("recipe")
        # tab10 repeats its colours past ten variants (the study has a dozen)
        colours = colormaps["tab10" if variants.ngroups <= 10 else "tab20"]
        for i, (variant, part) in enumerate(variants):
            stats = part.groupby("step")[metric].agg(["mean", "std", "count"])
            stats[["mean", "std"]] = stats[["mean", "std"]].rolling(SMOOTH, min_periods=1
                                                                    ).mean()
            spread = stats["std"].fillna(0)
            ax.plot(stats.index, stats["mean"], color=colours(i),
                    label=f"{variant} ({stats['count'].max()})")
            ax.fill_between(stats.index, stats["mean"] - spread, stats["mean"] + spread,
                            color=colours(i), alpha=0.15)

    return [_by_step(group, draw, f"{model}: mean +- std over seeds (in brackets), "
                     f"{SMOOTH}-step running mean", out / f"science_{model}.png")
            for model, group in runs.groupby("model")]


def entropy(frames: dict, paper: pd.DataFrame, out: Path) -> list[Path]:
    """Per model and card: mean token entropy by weight format, on each variant's own
    samples and on BF16's, with 95% bootstrap intervals."""
    rows = frames.get("entropy")
    if rows is None:
        return []
    plt = _pyplot()
    written = []
    for (model, card), group in rows.groupby(["model", "card"]):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        x = np.arange(len(group))
        for offset, kind in ((-0.18, "own"), (0.18, "shared")):
            means = group[f"{kind}_entropy"].to_numpy()
            if f"{kind}_low" in group:
                errors = [means - group[f"{kind}_low"].to_numpy(),
                          group[f"{kind}_high"].to_numpy() - means]
            else:
                errors = None
            ax.bar(x + offset, means, width=0.36, yerr=errors, capsize=3,
                   label=f"{kind} samples")
        ax.set_xticks(x, group.method)
        size = ("" if group.prompts.isna().all() else
                f": {group.prompts.max():.0f} prompts x {group.tokens.max():.0f} tokens")
        ax.set(ylabel="mean token entropy (nats)", title=f"{model}, {card}{size}")
        ax.legend(fontsize=7)
        written.append(_save(plt, fig, out / per_card(f"entropy_{model}", card, ".png")))
    return written


def _engine_rollouts(frames: dict) -> pd.DataFrame | None:
    rows = frames.get("rollout")
    if rows is None:
        return None
    # The engine as it runs: not Hugging Face generate, not vLLM, not the model's own modules.
    return rows[rows.method.isin(ROLLOUT_METHOD) & (rows.fused != 0)]


def _one_run(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows measured in one run with the newest of them (``different_runs``): a figure's
    lines compare those only, as the tables' ratios do."""
    if "date" not in rows or rows.date.isna().all():
        return rows
    newest = rows.loc[pd.to_datetime(rows.date).idxmax()]
    versions = (rows.qerl, newest.qerl) if "qerl" in rows else (None, None)
    runs = (rows.run, newest.run) if "run" in rows else (None, None)
    return rows[~different_runs(rows.date, newest.date, *versions, *runs).to_numpy()]


def rollout_by_rank(frames: dict, paper: pd.DataFrame, out: Path) -> list[Path]:
    """The paper's rollout figure, per card: tokens/s against LoRA rank for each (model,
    batch, samples a prompt, prompt, generated length, KV cache format) whose newest run
    measured several ranks, a line per weights, the paper's numbers dashed in the same colour
    (its LoRA, QLoRA and QeRL: our bf16, nf4 and nvfp4), Hugging Face generate as a dotted
    level."""
    engine = _engine_rollouts(frames)
    if engine is None:
        return []
    plt = _pyplot()
    theirs = paper[(paper.metric == "rollout_throughput") & paper.lora_rank.notna()]
    theirs = theirs.assign(model=theirs.model.map(paper_model))
    colours = {w: f"C{i}" for i, w in enumerate(ROLLOUT_METHOD)}
    settings = ["model", "batch", "group", "prompt_len", "gen_len", "kv_cache"]
    written = []
    for card, rows in engine.groupby("card"):
        panels = [(k, run) for k, g in rows.groupby(settings, dropna=False)
                  if (run := _one_run(g)).lora_rank.nunique() > 1]
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8),
                                 squeeze=False)
        for ax, ((model, batch, group, prompt_len, gen_len, kv_cache), sel) in zip(
                axes[0], panels, strict=True):
            for weights, g in sel.groupby("method"):
                g = g.sort_values("lora_rank")
                ax.plot(g.lora_rank, g.tok_per_s, marker="o", color=colours.get(weights),
                        label=f"ours {weights}")
                method = ROLLOUT_METHOD.get(weights)
                ref = theirs[(theirs.model == paper_model(model)) & (theirs.method == method)]
                if len(ref):
                    ax.plot(ref.lora_rank, ref.value, ls="--", marker="x",
                            color=colours.get(weights), label=f"paper {method}")
            hf = frames["rollout"]
            hf = hf[(hf.method == "hf-bf16") & (hf.card == card) & (hf.model == model)
                    & (hf.batch == batch) & (hf.prompt_len == prompt_len)]
            if len(hf):
                ax.axhline(hf.tok_per_s.iloc[-1], color="grey", ls=":",
                           label="HF generate bf16")
            shape = (f"batch {batch:g}" + (f" ({group:g} a prompt)" if group != 1 else "")
                     + cache_label(kv_cache))
            ax.set(title=f"{model} {shape} prompt {prompt_len:g} gen {gen_len:g}",
                   xlabel="LoRA rank", ylabel="tokens/s")
            ax.legend(fontsize=7)
        fig.suptitle(f"Rollout throughput by LoRA rank, {card} (each panel one run)")
        written.append(_save(plt, fig, out / per_card("rollout_by_rank", card, ".png")))
    return written


def rollout_speedup(frames: dict, paper: pd.DataFrame, out: Path) -> list[Path]:
    """Per card: NVFP4's rollout tokens/s over BF16's (``tables.rollout``'s ratio: one run,
    LoRA attached) against the batch, a line per model, rank, samples a prompt, prompt and
    generated length and KV cache format, for the engine as it runs (fused)."""
    table = rollout(frames, paper)
    if table.empty or "nvfp4/bf16" not in table:
        return []
    plt = _pyplot()
    written = []
    for card, rows in table[table.fused != 0].groupby("card"):
        rows = rows.dropna(subset=["nvfp4/bf16"])
        if rows.empty:
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for (model, rank, group, prompt_len, gen_len, kv_cache), g in rows.groupby(
                ["model", "lora_rank", "group", "prompt_len", "gen_len", "kv_cache"],
                dropna=False):
            g = g.sort_values("batch")
            shape = (f" ({group:g} a prompt)" if group != 1 else "") + cache_label(kv_cache)
            ax.plot(g.batch, g["nvfp4/bf16"], marker="o",
                    label=f"{model} r{rank:g}{shape} prompt {prompt_len:g} gen {gen_len:g}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="batch (sequences)", ylabel="NVFP4 tokens/s / BF16 tokens/s",
               title=f"Rollout speed-up of NVFP4 over BF16, {card}")
        ax.legend(fontsize=6)
        written.append(_save(plt, fig, out / per_card("rollout_speedup", card, ".png")))
    return written


def kernel_speedups(frames: dict, paper: pd.DataFrame, out: Path) -> list[Path]:
    """Per card: the NVFP4 matmul's speed-up over cuBLAS BF16 against M, forward and input
    gradient by layer, a line per model; dotted, the ceiling physics allows
    (``collect.kernel_ceiling``: its fewest bytes or its multiply, whichever takes longer)."""
    rows = frames.get("kernels")
    if rows is None:
        return []
    plt = _pyplot()
    written = []
    for card, group in rows.groupby("card"):
        layers = list(dict.fromkeys(group.layer))
        fig, axes = plt.subplots(2, len(layers), figsize=(4 * len(layers), 7), sharey=True,
                                 squeeze=False)
        for row, op in enumerate(("fwd", "bwd")):
            for col, layer in enumerate(layers):
                ax = axes[row][col]
                sel = group[(group.method == op) & (group.layer == layer)]
                for model, g in sel.groupby("model"):
                    g = g.sort_values("M")
                    ax.plot(g.M, g.speedup_vs_bf16, marker="o", label=model)
                    ax.plot(g.M, g.ceiling_vs_bf16, ls=":", alpha=0.5)
                ax.axhline(1.0, color="grey", lw=0.8)
                ax.set_xscale("log", base=2)
                ax.set(title=f"{layer} {op}", xlabel="M (tokens)")
        axes[0][0].set_ylabel("speed-up vs cuBLAS BF16 (dotted: ceiling)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"NVFP4 matmul, {card}")
        written.append(_save(plt, fig, out / per_card("kernels", card, ".png")))
    return written


def step(frames: dict, paper: pd.DataFrame, out: Path) -> list[Path]:
    """Per card and settings: each (model, method)'s step time stacked by phase with its
    speed against LoRA (the paper's in brackets), and its peak GPU memory against an 80 GB
    card (runs out of memory drawn in red, at the peak they reached)."""
    table = efficiency(frames, paper)
    if table.empty:
        return []
    plt = _pyplot()
    settings = step_settings(table)
    written = []
    for card, rows in table.groupby("card"):
        groups = list(rows.groupby(settings, sort=False))
        fig, axes = plt.subplots(2, len(groups), figsize=(1.1 * len(rows) + 3, 6.5),
                                 squeeze=False, sharey="row")
        for col, (values, group) in enumerate(groups):
            labels = [f"{m.removeprefix('qwen2.5-')}\n{method}"
                      for m, method in zip(group.model, group.method, strict=True)]
            bottom = np.zeros(len(group))
            for phase in [p for p in PHASES if f"{p}_s" in group]:
                heights = group[f"{phase}_s"].fillna(0).to_numpy()
                axes[0][col].bar(labels, heights, bottom=bottom, label=phase)
                bottom = bottom + heights
            for x, (top, ours, theirs) in enumerate(zip(
                    bottom, group["speed_vs_lora"], group["paper speed vs lora"],
                    strict=True)):
                if pd.notna(ours):
                    text = f"{ours:.2f}x" + (f"\n({theirs:.1f}x)" if pd.notna(theirs) else "")
                    axes[0][col].annotate(text, (x, top), ha="center", va="bottom",
                                          fontsize=6)
            s = dict(zip(settings, values, strict=True))
            axes[0][col].set_title(f"P={s['prompts']} G={s['generations']} "
                                   f"L={s['completion']} mb={s['micro_batch']}"
                                   + (" ckpt" if s["grad_ckpt"] else "")
                                   + (f" beside {s['busy']:g} busy" if s.get("busy") else ""),
                                   fontsize=8)
            colours = ["C3" if status == "oom" else "C7"
                       for status in group.get("status", [None] * len(group))]
            axes[1][col].bar(labels, group.peak_gb.fillna(0), color=colours)
            axes[1][col].axhline(80, color="k", ls=":", lw=1)
            for ax in axes[:, col]:
                ax.tick_params(axis="x", labelsize=7)
        axes[0][0].set_ylabel("step time (s)")
        axes[0][0].legend(fontsize=7)
        axes[1][0].set_ylabel("peak GPU memory (GB)\nred: out of memory")
        fig.suptitle(f"One RL step, {card}")
        written.append(_save(plt, fig, out / per_card("step", card, ".png")))
    return written


FIGURES = (curves, science_curves, entropy, rollout_by_rank, rollout_speedup,
           kernel_speedups, step)
