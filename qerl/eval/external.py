"""Base-model numbers as the paper took them: lm-evaluation-harness (GSM8K) and lighteval
(MATH-500, AIME24, AIME25) write their own results JSON; this reads either into rows like
``qerl eval``'s summary (one per benchmark and metric), so the report step reads one format.

    qerl eval-import OUT/lm-eval OUT/lighteval --out results/eval/base-7b

A folder is searched for its newest ``results_*.json`` (both tools timestamp their files and
never overwrite). The tool is recognised from the file's keys.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from qerl.atomic import make_directory
from qerl.eval.run import EvalError, write_summary

# The tools' task names -> ours. Copies of their tasks carry a suffix: "_local" (lm-eval,
# data from a file) or "_qerl" (lighteval, workflows/scripts/lighteval_tasks.py).
BENCHES = {"gsm8k": "gsm8k", "math_500": "math500", "aime24": "aime24", "aime25": "aime25",
           "amc23": "amc23"}


def results_file(path: Path) -> Path:
    """``path`` itself, or the newest ``results_*.json`` below it."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise EvalError(f"{path}: no such file or folder")
    found = sorted(path.rglob("results_*.json"), key=lambda p: p.name)
    if not found:
        raise EvalError(f"{path}: no results_*.json below it (did the evaluation finish?)")
    return found[-1]


def bench_of(task: str) -> str:
    """'gsm8k', 'gsm8k_local', 'lighteval|math_500|0', 'math_500_qerl|0' -> ours."""
    parts = task.split("|")
    name = parts[1] if len(parts) == 3 else parts[0]
    name = name.removesuffix("_local").removesuffix("_qerl")
    if name not in BENCHES:
        raise EvalError(f"task {task!r} is none of the benchmarks we compare "
                        f"({', '.join(BENCHES)})")
    return BENCHES[name]


def _date(file: Path) -> str | None:
    """The run's start, from the timestamp both tools put in the file name."""
    stamp = re.search(r"(\d{4}-\d{2}-\d{2})T(\d{2})[-:](\d{2})", file.name)
    return f"{stamp.group(1)} {stamp.group(2)}:{stamp.group(3)}" if stamp else None


def _lm_eval_rows(doc: dict) -> list[dict]:
    config = doc.get("config", {})
    model = config.get("model_args")
    if isinstance(model, dict):  # 0.4.13 keeps the parsed arguments
        model = model.get("pretrained", model)
    common = {"tool": "lm-eval", "tool_version": doc.get("lm_eval_version"), "model": model,
              "limit": config.get("limit")}
    rows = []
    for task, metrics in doc["results"].items():
        problems = doc.get("n-samples", {}).get(task, {}).get("effective")
        shots = doc.get("n-shot", {}).get(task)
        for key, value in metrics.items():
            metric, sep, filt = key.partition(",")
            if not sep or metric.endswith("_stderr"):
                continue  # "alias", "sample_len"; stderrs go beside their metric
            rows.append({**common, "bench": bench_of(task), "task": task, "shots": shots,
                         "metric": key, "value": value, "problems": problems,
                         "stderr": metrics.get(f"{metric}_stderr,{filt}")})
    return rows


def _lighteval_rows(doc: dict) -> list[dict]:
    general = doc.get("config_general", {})
    # lighteval records neither its version nor a wall-clock date in the file.
    common = {"tool": "lighteval", "tool_version": None, "model": general.get("model_name"),
              "limit": general.get("max_samples")}
    rows = []
    for task, metrics in doc["results"].items():
        if task == "all":  # averages same-named metrics across tasks: not a benchmark
            continue
        shots = re.search(r"\|(\d+)$", task)
        for key, value in metrics.items():
            if key.endswith("_stderr"):
                continue
            rows.append({**common, "bench": bench_of(task), "task": task,
                         "shots": int(shots.group(1)) if shots else None, "metric": key,
                         "value": value, "problems": None, "stderr": metrics.get(f"{key}_stderr")})
    return rows


def read_results(path: Path) -> list[dict]:
    """Summary rows of one lm-eval or lighteval results file (or the newest below a folder)."""
    file = results_file(Path(path))
    try:
        doc = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise EvalError(f"{file}: not a readable results JSON ({err})") from err
    if not isinstance(doc, dict) or "results" not in doc:
        raise EvalError(f"{file}: no 'results' in it: not an lm-eval or lighteval results file")
    if "lm_eval_version" in doc or "n-samples" in doc:
        rows = _lm_eval_rows(doc)
    elif "config_general" in doc:
        rows = _lighteval_rows(doc)
    else:
        raise EvalError(f"{file}: neither lm-eval's (lm_eval_version) nor lighteval's "
                        "(config_general) results")
    if not rows:
        raise EvalError(f"{file}: holds no metric values")
    return [{"date": _date(file), **row, "source": str(file)} for row in rows]


def import_results(paths: list[Path], out_dir: Path) -> list[dict]:
    """Read every results file in ``paths`` and write ``out_dir/summary.{json,csv}``."""
    rows = [row for path in paths for row in read_results(Path(path))]
    make_directory(out_dir)
    write_summary(out_dir, rows)
    return rows
