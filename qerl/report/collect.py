"""Read the results tree into one long table of values, one row per number:

    kind, model, recipe, method, bench, metric, value, source

kind is eval (qerl eval summaries, trained and base), external (lm-eval / lighteval base
numbers), train (every logged step of every run), rollout, kernels and step (benchmarks).
A row's
key (``key()``) names it uniquely and stably, so expected values can refer to it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

COLUMNS = ["kind", "model", "recipe", "method", "bench", "metric", "value", "source"]
EVAL_METRICS = ("avg@", "pass@")
TRAIN_METRICS = ("reward", "entropy", "loss", "step_time", "rollout/tokens_per_s",
                 "memory/peak_gb", "aqn/sigma")


def key(row) -> str:
    parts = (row["kind"], row["model"], row["recipe"], row["method"], row["bench"],
             row["metric"])
    return "/".join(str(p) for p in parts if isinstance(p, str) and p)


def _eval(results: Path) -> list[dict]:
    rows = []
    for summary in sorted(results.glob("eval/*/*/*/summary.csv")):
        model, recipe, method = summary.parts[-4:-1]
        if method == "external":  # lm-eval / lighteval rows: below
            continue
        table = pd.read_csv(summary)
        for record in table.to_dict("records"):
            metrics = [c for c in table.columns if c.startswith(EVAL_METRICS)]
            rows += [{"kind": "eval", "model": model, "recipe": recipe, "method": method,
                      "bench": record["bench"], "metric": m, "value": record[m],
                      "source": str(summary)} for m in metrics]
    for summary in sorted(results.glob("eval/*/base/external/summary.csv")):
        model = summary.parts[-4]
        for record in pd.read_csv(summary).to_dict("records"):
            rows.append({"kind": "external", "model": model, "recipe": "base",
                         "method": record["tool"], "bench": record["bench"],
                         "metric": record["metric"], "value": record["value"],
                         "source": str(summary)})
    return rows


def _train(results: Path) -> list[dict]:
    rows = []
    for metrics in sorted(results.glob("train/*/*/*/metrics.csv")):
        model, recipe, method = metrics.parts[-4:-1]
        table = pd.read_csv(metrics)
        for record in table.to_dict("records"):
            rows += [{"kind": "train", "model": model, "recipe": recipe, "method": method,
                      "bench": f"step{int(record['step'])}", "metric": m, "value": record[m],
                      "source": str(metrics)}
                     for m in TRAIN_METRICS if m in table and pd.notna(record[m])]
    return rows


def _rollout(results: Path) -> list[dict]:
    rows = []
    for csv in sorted(results.glob("bench/**/rollout_*.csv")):
        for r in pd.read_csv(csv).to_dict("records"):
            rows.append({"kind": "rollout", "model": r["model"], "recipe": r["card"],
                         "method": r["weights"],
                         "bench": f"r{r['lora_rank']}-b{r['batch']}-p{r['prompt_len']}",
                         "metric": "tok_per_s", "value": r["tok_per_s"], "source": str(csv)})
    return rows


def _kernels(results: Path) -> list[dict]:
    rows = []
    for csv in sorted(results.glob("bench/**/kernels_*.csv")):
        for r in pd.read_csv(csv).to_dict("records"):
            rows.append({"kind": "kernels", "model": r["model"], "recipe": r["card"],
                         "method": r["op"], "bench": f"{r['layer']}-M{r['M']}",
                         "metric": "speedup_vs_bf16", "value": r["speedup_vs_bf16"],
                         "source": str(csv)})
    return rows


def _efficiency(results: Path) -> list[dict]:
    """The newest step of each model, method and settings, with its speed against LoRA's
    from the same run (``qerl bench step``'s own pairing)."""
    from qerl.bench.step import compare

    rows = []
    for csv in sorted(results.glob("bench/**/efficiency_*.csv")):
        frame = compare(pd.read_csv(csv)).rename(columns={"speed vs lora": "speed_vs_lora"})
        for r in frame.to_dict("records"):
            setting = f"G{r['generations']}-L{r['completion']}-P{r['prompts']}"
            rows += [{"kind": "step", "model": r["model"], "recipe": r["card"],
                      "method": r["method"], "bench": setting, "metric": m, "value": r[m],
                      "source": str(csv)}
                     for m in ("step_s", "rollout_s", "train_s", "peak_gb", "speed_vs_lora")
                     if pd.notna(r[m])]
    return rows


def _science(results: Path) -> list[dict]:
    """The study's runs (science/MODEL/VARIANT/seedN/): every step, the held-out accuracy,
    and the entropy benchmark."""
    rows = []
    for metrics in sorted(results.glob("science/*/*/seed*/metrics.csv")):
        model, variant, seed = metrics.parts[-4:-1]
        for record in pd.read_csv(metrics).to_dict("records"):
            rows += [{"kind": "science", "model": model, "recipe": variant, "method": seed,
                      "bench": f"step{int(record['step'])}", "metric": m, "value": record[m],
                      "source": str(metrics)}
                     for m in ("reward", "entropy") if m in record and pd.notna(record[m])]
    for summary in sorted(results.glob("science/*/*/seed*/eval/summary.csv")):
        model, variant, seed = summary.parts[-5:-2]
        for record in pd.read_csv(summary).to_dict("records"):
            rows += [{"kind": "science", "model": model, "recipe": variant, "method": seed,
                      "bench": f"held-out-{record['bench']}", "metric": m, "value": record[m],
                      "source": str(summary)} for m in record if m.startswith(EVAL_METRICS)]
    for csv in sorted(results.glob("science/*/entropy/entropy_*.csv")):
        for r in pd.read_csv(csv).to_dict("records"):
            rows += [{"kind": "entropy", "model": csv.parts[-3], "recipe": r["card"],
                      "method": r["weights"], "bench": kind, "metric": "entropy",
                      "value": r[f"{kind}_entropy"], "source": str(csv)}
                     for kind in ("own", "shared")]
    return rows


def collect(results: Path) -> pd.DataFrame:
    """Every number under ``results`` (see the module docstring); later rows of the same key
    (a benchmark rerun appends) replace earlier ones."""
    rows = (_eval(results) + _train(results) + _rollout(results) + _kernels(results)
            + _efficiency(results) + _science(results))
    table = pd.DataFrame(rows, columns=COLUMNS)
    if table.empty:
        return table.assign(key=pd.Series(dtype=str))
    table["key"] = table.apply(key, axis=1)
    return table.drop_duplicates("key", keep="last").reset_index(drop=True)
