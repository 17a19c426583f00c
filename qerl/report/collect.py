"""Read a results tree: one frame per kind of result (the rows of every file of that kind,
with the columns that name them), and from the frames one long table of every number:

    kind, card, model, recipe, method, bench, metric, value, source

Where each kind is read from, below the results folder (``**``: any depth, so both the
committed files and the workflow's ``bench/NAME/`` folders are read):

    eval          eval/MODEL/RECIPE/METHOD/summary.csv       qerl eval (base: RECIPE base,
                                                               METHOD bf16 or nvfp4)
    external      eval/MODEL/RECIPE/external/summary.csv      lm-eval, lighteval
    train         train/MODEL/RECIPE/METHOD/metrics.csv       + provenance.json, config.yaml
    science       science/MODEL/VARIANT/seedN/metrics.csv     + provenance.json, config.yaml
    held-out      science/MODEL/VARIANT/seedN/eval/summary.csv
    the benchmarks' kinds (entropy, rollout, kernels, ..., as qerl.bench.registry lists them):
                  its patterns there, e.g. bench/**/rollout_*.csv

A number's ``key()`` (kind/model/recipe/method/bench/metric) names it uniquely and stably,
so expected values can refer to it; ``bench`` joins the columns that set the measurement
(e.g. ``lora_rank=32,batch=16,...``), or names the step or benchmark. For measurements
RECIPE is the card. Where a file holds a measurement twice (a benchmark rerun appends), the
later row wins; the rows it replaced stay readable under ``every(kind)``, for ratios.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pandas as pd
import yaml

from qerl.bench.registry import BENCHMARKS, Benchmark
from qerl.errors import QerlError

COLUMNS = ["kind", "card", "model", "recipe", "method", "bench", "metric", "value", "source"]
IDENTITY = ["model", "recipe", "method", "bench"]
EVAL_METRICS = ("avg@", "pass@")
# Mean |log p_sampler - log p_trainer| a token: what the rollout engine (ours or vLLM)
# and the training forward disagree by.
MISMATCH = "mismatch/logp_diff_mean"
TRAIN_METRICS = ("reward", "entropy", "loss", "step_time", "rollout/tokens_per_s",
                 "memory/peak_gb", "aqn/sigma", MISMATCH)
# A ratio pairs measurements of one run: rows that name their run (every benchmark row since
# run ids were written) by it; older rows if taken within this time of each other by one qerl
# version (one run, or runs back to back on one machine), so that no ratio mixes code
# versions or machines.
PAIR_WINDOW_HOURS = 1.0
STEP_SETTINGS = next(b.setting for b in BENCHMARKS if b.name == "step")


def step_settings(frame: pd.DataFrame) -> list[str]:
    """The STEP_SETTINGS columns ``frame`` has (a file older than a setting lacks it)."""
    return [column for column in STEP_SETTINGS if column in frame]


def every(kind: str) -> str:
    """The frame key of all rows of ``kind``, those a later row replaced too: a ratio pairs
    two methods' rows from one run, and a later run of one method alone must not hide the
    pair an earlier run measured."""
    return f"{kind}:every"


class ResultsError(QerlError):
    """A results file that cannot be read as the kind of result its path says it is."""


def key(row) -> str:
    parts = (row["kind"], row["model"], row["recipe"], row["method"], row["bench"],
             row["metric"])
    return "/".join(str(p) for p in parts if isinstance(p, str) and p)


# ---- readers: a file -> its rows with the naming columns, and the files they read --------

def _path_names(path: Path, *names: str, above: int = 1) -> dict[str, str]:
    """The folder names above ``path``'s own folder (``above`` levels up first), e.g.
    eval/MODEL/RECIPE/METHOD/summary.csv -> {model, recipe, method}."""
    folders = path.parts[:len(path.parts) - above]
    return dict(zip(names, folders[-len(names):], strict=True))


def _run_context(folder: Path) -> tuple[dict, list[Path]]:
    """The card (provenance.json), learning rate and rollout backend (config.yaml) of a
    training run."""
    context, read = {}, []
    provenance, config = folder / "provenance.json", folder / "config.yaml"
    if provenance.is_file():
        context["card"] = json.loads(provenance.read_text()).get("card")
        read.append(provenance)
    if config.is_file():
        settings = yaml.safe_load(config.read_text()) or {}
        train = settings.get("train") or {}
        context["learning_rate_set"] = train.get("learning_rate")
        context["backend"] = (settings.get("engine") or {}).get("backend")
        read.append(config)
    return context, read


def _eval(path: Path):
    names = _path_names(path, "model", "recipe", "method")
    if names["method"] == "external":
        return None, []
    return pd.read_csv(path).assign(**names), [path]


def _external(path: Path):
    names = _path_names(path, "model", "recipe", above=2)
    frame = pd.read_csv(path).rename(columns={"tool": "method"})
    return frame.assign(**names, card=None), [path]


def _steps(path: Path, recipe_name: str):
    names = _path_names(path, "model", recipe_name, "method")
    context, read = _run_context(path.parent)
    frame = pd.read_csv(path).assign(**names, **context)
    return frame.rename(columns={recipe_name: "recipe"}), [path, *read]


def _held_out(path: Path):
    names = _path_names(path, "model", "recipe", "method", above=2)
    frame = pd.read_csv(path).drop(columns=["model", "method"], errors="ignore")
    return frame.assign(**names), [path]


def _measurements(benchmark: Benchmark, path: Path):
    """A benchmark's rows, named as its registration says (qerl.bench.registry)."""
    frame = pd.read_csv(path)
    if benchmark.model_in_layer:
        model_layer = frame.layer.str.rsplit(".", n=1, expand=True)
        frame = frame.assign(model=model_layer[0], layer=model_layer[1])
    if benchmark.card is not None:
        frame = frame.assign(card=benchmark.card)
    if benchmark.model_from_path:
        frame = frame.drop(columns="model", errors="ignore").assign(model=path.parts[-3])
    return frame, [path]


# ---- derived columns ----------------------------------------------------------------------

def different_runs(date_a, date_b, version_a=None, version_b=None, run_a=None, run_b=None):
    """Whether two measurements (aligned Series, or a Series and a scalar) cannot come from
    one run: where both name their run (``run_a``, ``run_b``), whether the names differ;
    else, dated more than PAIR_WINDOW_HOURS apart, or made by two qerl versions (commits)
    where both record theirs. Undated rows without a run are not told apart."""
    apart = abs(pd.to_datetime(date_a) - pd.to_datetime(date_b)) > pd.Timedelta(
        hours=PAIR_WINDOW_HOURS)
    if version_a is not None and version_b is not None:
        apart = apart | (pd.notna(version_a) & pd.notna(version_b) & (version_a != version_b))
    if run_a is None or run_b is None:
        return apart
    named = pd.notna(run_a) & pd.notna(run_b)
    return (named & (run_a != run_b)) | (~named & apart)


def run_ratio(over: pd.DataFrame, under: pd.DataFrame, on: list[str], value: str,
              keep: list[str] | None = None) -> pd.DataFrame:
    """over[value] / under[value] for the rows alike in ``on``, where both come from one run
    (``different_runs``: one run id, or for older rows dated within PAIR_WINDOW_HOURS by one
    qerl version; a ratio across runs is no ratio), and where several runs measured both,
    from the latest of them: a column "ratio" beside ``keep`` (default ``on``; columns of
    ``over``)."""
    keep = keep or on
    stamps = [c for c in ("date", "qerl", "run") if c in over and c in under]
    both = over[[*keep, value, *stamps]].merge(under[[*on, value, *stamps]], on=on,
                                               suffixes=("", " under"))
    if "date" in stamps:
        both = both[~different_runs(both.date, both["date under"],
                                    *_stamp(both, "qerl", stamps),
                                    *_stamp(both, "run", stamps)).to_numpy()]
        latest = pd.concat([pd.to_datetime(both.date), pd.to_datetime(both["date under"])],
                           axis=1).max(axis=1)
        both = both.assign(latest=latest).sort_values("latest", kind="stable",
                                                      na_position="first")
    both = both.assign(ratio=both[value] / both[f"{value} under"])
    return both.drop_duplicates(keep, keep="last")[[*keep, "ratio"]]


def _stamp(both: pd.DataFrame, column: str, stamps: list[str]) -> tuple:
    """A merged pair's two values of ``column`` (None, None where the rows lack it)."""
    return (both[column], both[f"{column} under"]) if column in stamps else (None, None)


def speed_vs_lora(frame: pd.DataFrame, every: pd.DataFrame | None = None) -> pd.Series:
    """Each step's speed against LoRA's at the same card, model and settings (LoRA's time
    over its own), from one run (``run_ratio``: the latest run that measured both, among
    ``every`` row read; default ``frame``), where both times were measured; NaN for a row
    that ran out of memory, and where no run measured both."""
    every = frame if every is None else every
    group = ["card", "model", *step_settings(every)]
    timed = every[every.step_s > 0]
    lora = timed[timed.method == "lora"]
    speed = pd.Series(float("nan"), index=frame.index)
    for method, rows in frame.groupby("method", sort=False):
        paired = run_ratio(lora, timed[timed.method == method], group, "step_s")
        speed[rows.index] = rows[group].merge(paired, on=group, how="left").ratio.to_numpy()
    return speed.where(frame.step_s > 0)


def _with_speed(frame: pd.DataFrame, every: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(speed_vs_lora=speed_vs_lora(frame, every))


# cuBLAS BF16's GEMMs of this many rows or more are compute-bound: the best rate it reaches
# there stands in for the card's dense BF16 rate (a datasheet's peak is not reached).
RATE_FROM_M = 2048


def kernel_ceiling(frame: pd.DataFrame) -> pd.Series:
    """Each matmul's ceiling over cuBLAS BF16: cuBLAS's time over the least an NVFP4 matmul
    of its shape can take on that card, the longer of moving its fewest bytes at the copy
    bandwidth measured in its run (``floor_us``) and multiplying (2 M N K) at the best rate
    cuBLAS BF16 reached on the card from RATE_FROM_M rows. NaN where either is unknown."""
    if not {"floor_us", "bf16_us", "M", "N", "K"} <= set(frame):
        return pd.Series(float("nan"), index=frame.index)
    flops = 2.0 * frame.M * frame.N * frame.K
    rate = (flops / frame.bf16_us).where(frame.M >= RATE_FROM_M).groupby(
        frame.card).transform("max")
    least = pd.concat([frame.floor_us, flops / rate], axis=1).max(axis=1, skipna=False)
    return frame.bf16_us / least


def _with_ceiling(frame: pd.DataFrame, every: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(ceiling_vs_bf16=kernel_ceiling(frame))


# ---- the kinds ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    """One kind of result: where its files are (``patterns``), how a file becomes rows
    (``reader``), the columns naming its method and model, the columns that set the
    measurement (``setting``, joined into ``bench``, or ``label`` from a row), those that
    hold its numbers (``metrics``, names or prefixes), columns computed over the latest rows
    and every row read (``derive``), and the value a setting had before its column was written
    (``defaults``)."""

    patterns: tuple[str, ...]
    reader: Callable
    method: str = "method"
    model: str = "model"
    measured: bool = True  # a measurement: its recipe is the card (else read from the path)
    setting: tuple[str, ...] = ()
    label: Callable | None = None
    metrics: tuple[str, ...] = ()
    prefixed: bool = False  # metrics are column-name prefixes
    long: bool = False  # rows carry a metric name and its value
    derive: Callable | None = field(default=None)
    defaults: dict = field(default_factory=dict)


def _setting_label(columns: tuple[str, ...], defaults: dict):
    """``a=1,b=2`` of the setting columns a row has (a file older than a column has none),
    but those at their ``defaults``: a row's key stays what it was before the column."""
    def label(row) -> str:
        return ",".join(f"{c}={_plain(row[c])}" for c in columns
                        if c in row and pd.notna(row[c])
                        and not (c in defaults and row[c] == defaults[c]))
    return label


def _plain(value):
    """1.0 -> 1: integer settings read back from a CSV column with gaps are floats."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _step_label(row) -> str:
    return f"step{int(row['step'])}"


def _bench_label(row) -> str:
    return row["bench"]


# Columns the report computes over a benchmark's rows, by its name.
DERIVED = {"kernels": _with_ceiling, "step": _with_speed}


def _measured(benchmark: Benchmark) -> Kind:
    """The kind of a registered benchmark's rows."""
    return Kind(benchmark.patterns, partial(_measurements, benchmark), method=benchmark.method,
                model=benchmark.model, setting=benchmark.setting, metrics=benchmark.metrics,
                derive=DERIVED.get(benchmark.name), defaults=benchmark.defaults)


KINDS = {
    "eval": Kind(("eval/*/*/*/summary.csv",), _eval, measured=False, label=_bench_label,
                 metrics=EVAL_METRICS, prefixed=True),
    "external": Kind(("eval/*/*/external/summary.csv",), _external, measured=False,
                     label=_bench_label, long=True),
    "train": Kind(("train/*/*/*/metrics.csv",), lambda p: _steps(p, "recipe"),
                  measured=False, label=_step_label, metrics=TRAIN_METRICS),
    "science": Kind(("science/*/*/seed*/metrics.csv",), lambda p: _steps(p, "variant"),
                    measured=False, label=_step_label, metrics=("reward", "entropy")),
    "held-out": Kind(("science/*/*/seed*/eval/summary.csv",), _held_out, measured=False,
                     label=_bench_label, metrics=EVAL_METRICS, prefixed=True),
    **{b.name: _measured(b) for b in BENCHMARKS},
}


@dataclass
class Results:
    """A results tree read: ``frames`` by kind, ``values`` (the long table) and every
    file that was read."""

    frames: dict[str, pd.DataFrame]
    values: pd.DataFrame
    files: set[Path]


def read(name: str, paths: list[Path]) -> tuple[pd.DataFrame, pd.DataFrame, set[Path]]:
    """The frame of kind ``name`` from ``paths`` (a measurement's latest row), every row
    read (oldest first), and the files read for it (a training run's provenance and
    settings beside its metrics)."""
    kind = KINDS[name]
    parts, files = [], set()
    for path in paths:
        try:
            frame, read_files = kind.reader(path)
        except (OSError, ValueError, KeyError, AttributeError, yaml.YAMLError) as e:
            raise ResultsError(f"{path}: cannot be read as {name} results: {e}") from e
        if frame is None:
            continue
        files.update(read_files)
        # Renamed first: quantize's method column is named source, the file's column here.
        frame = frame.rename(columns={kind.method: "method", kind.model: "model"})
        missing = [given for given, column in ((kind.model, "model"), (kind.method, "method"))
                   if column not in frame]
        if missing:
            raise ResultsError(f"{path}: {name} results need the column(s) {missing}")
        parts.append(frame.assign(source=str(path)))
    if not parts:
        return pd.DataFrame(), pd.DataFrame(), files
    frame = pd.concat(parts, ignore_index=True)
    for column in ("card", *kind.setting):  # a file older than the column lacks it
        if column not in frame:
            frame[column] = None
        if column in kind.defaults:
            frame[column] = frame[column].fillna(kind.defaults[column])
    if kind.measured:
        frame["recipe"] = frame["card"]
    label = kind.label or _setting_label(kind.setting, kind.defaults)
    frame["bench"] = [label(row) for row in frame.to_dict("records")]
    identity = [*IDENTITY, "metric"] if kind.long else IDENTITY
    latest = frame.drop_duplicates(identity, keep="last").reset_index(drop=True)
    if kind.derive is not None:
        latest = kind.derive(latest, frame)
    return latest, frame, files


def _long(name: str, kind: Kind, frame: pd.DataFrame) -> list[dict]:
    ident = ["card", "model", "recipe", "method", "bench", "source"]
    if kind.long:
        rows = frame[[*ident, "metric", "value"]].to_dict("records")
    else:
        metrics = [c for c in frame.columns
                   if (c.startswith(kind.metrics) if kind.prefixed else c in kind.metrics)]
        rows = frame[ident + metrics].melt(id_vars=ident, var_name="metric").to_dict("records")
    return [{**row, "kind": name} for row in rows
            if pd.api.types.is_number(row["value"]) and pd.notna(row["value"])]


def collect(results: Path) -> Results:
    """Every result under ``results`` (see the module docstring)."""
    frames, files, rows = {}, set(), []
    for name, kind in KINDS.items():
        paths = [path for pattern in kind.patterns for path in sorted(results.glob(pattern))]
        frame, rows_read, read_files = read(name, paths)
        files |= read_files
        if not frame.empty:
            frames[name], frames[every(name)] = frame, rows_read
            rows += _long(name, kind, frame)
    values = pd.DataFrame(rows, columns=COLUMNS)
    values["key"] = [key(row) for row in values.to_dict("records")] if len(values) else []
    values = values.drop_duplicates("key", keep="last").reset_index(drop=True)
    return Results(frames, values, files)
