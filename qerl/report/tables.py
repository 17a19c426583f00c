"""Tables of the results, one per kind (collect.KINDS), the paper's numbers beside ours where
it gives them. Each takes the frames ``collect`` read and the paper's numbers, and returns
an empty frame when there is nothing to show."""

from __future__ import annotations

import pandas as pd

from qerl import archs
from qerl.bench.registry import BENCHMARKS
from qerl.methods import METHODS
from qerl.report.collect import KINDS, MISMATCH, every, run_ratio
from qerl.rl.phases import PHASES

PAPER_METRIC = {"gsm8k": "gsm8k_accuracy", "math500": "math500_accuracy"}
# Our rollout weights -> the paper's method for the same rollout (LoRA on a BF16 base, QLoRA
# on NF4, qerl on NVFP4).
ROLLOUT_METHOD = {"bf16": "lora", "nf4": "qlora", "nvfp4": "qerl"}


def paper_model(model: str) -> str:
    """'qwen2.5-7b-instruct', 'Qwen2.5-7B-Instruct' and 'qwen2.5-7b' all name the paper's
    Qwen2.5-7B-Instruct."""
    return model.lower().removesuffix("-instruct")


def _present(frame: pd.DataFrame, columns) -> list[str]:
    return [c for c in columns if c in frame]


def _by_size(column: pd.Series) -> pd.Series:
    """Sort key: models by the size in their name (qwen2.5-7b before qwen2.5-14b), methods
    in the project's order, anything else as it is."""
    if column.name == "model":
        return column.str.extract(r"(\d+(?:\.\d+)?)b", expand=False).astype(float).fillna(0)
    if column.name == "method":
        return column.map(lambda m: METHODS.index(m) if m in METHODS else len(METHODS))
    return column


def _sorted(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    return frame.sort_values(_present(frame, by), key=_by_size, kind="stable"
                             ).reset_index(drop=True)


def _wide(frame: pd.DataFrame, index: list[str], columns: str, values: str) -> pd.DataFrame:
    """One row per ``index``, a column per value of ``columns`` (rows are unique per
    measurement: collect keeps the newest). Unlike pivot_table it keeps rows whose settings
    are partly missing (a file older than a setting's column)."""
    wide = frame.set_index([*index, columns])[values].unstack(columns)
    wide.columns.name = None
    return wide.reset_index()


def _by_weights(frames: dict, kind: str, value: str, speedup: str, more: tuple = (),
                rows=lambda frame: frame) -> pd.DataFrame:
    """A row per card, model and setting of ``kind``, a column of ``value`` per weights (the
    latest row of each), and NVFP4's speed-up over BF16 (``speedup``: "nvfp4/bf16" for a
    rate, "bf16/nvfp4" for a time) and the ratios ``more`` names as (column, over, under),
    each from one run (``run_ratio``). ``rows`` shapes the frame and every row read alike."""
    index = ["card", "model", *KINDS[kind].setting]
    latest = rows(frames[kind])
    measured = rows(frames.get(every(kind), frames[kind]))
    wide = _wide(latest, index, "method", value)
    for name, over, under in ((speedup, *speedup.split("/")), *more):
        if {over, under} <= set(wide.columns):
            paired = run_ratio(measured[measured.method == over],
                               measured[measured.method == under], index, value)
            wide = wide.merge(paired.rename(columns={"ratio": name}), on=index, how="left")
    return wide


# The KV cache format the others are compared with (qerl.formats.kv_cache: the model's own
# dtype, every row's before --kv-cache).
BASE_CACHE = "bf16"


def cache_label(kv_cache: str) -> str:
    """A KV cache format named where it is not BASE_CACHE (" fp8 KV cache"), else ""."""
    return "" if kv_cache == BASE_CACHE else f" {kv_cache} KV cache"


def _over_base_cache(rows: pd.DataFrame, wide: pd.DataFrame, index: list[str], value: str,
                     rate: bool) -> pd.DataFrame:
    """``wide`` (a row per ``index``, the KV cache format among it) with each weights'
    speed in another KV cache format over its own in BASE_CACHE's, at the same settings and
    from one run (``run_ratio`` over ``rows``), on that format's row: "WEIGHTS fp8/bf16
    cache" of a rate, "WEIGHTS bf16/fp8 cache" of a time: above 1, that format is faster."""
    on = [c for c in index if c != "kv_cache"]
    base = rows[rows.kv_cache == BASE_CACHE]
    for (weights, cache), other in rows[rows.kv_cache != BASE_CACHE].groupby(
            ["method", "kv_cache"]):
        own = base[base.method == weights]
        over, under = (other, own) if rate else (own, other)
        name = (f"{weights} {cache}/{BASE_CACHE} cache" if rate else
                f"{weights} {BASE_CACHE}/{cache} cache")
        paired = run_ratio(over, under, on, value).assign(kv_cache=cache)
        wide = wide.merge(paired.rename(columns={"ratio": name}), on=index, how="left")
    return wide


def listing(kind: str):
    """The default table of a kind: one row per measurement, its settings and numbers."""

    def table(frames: dict, paper: pd.DataFrame | None = None) -> pd.DataFrame:
        frame = frames.get(kind)
        if frame is None:
            return pd.DataFrame()
        spec = KINDS[kind]
        columns = ["card", "model", "method", *spec.setting, *spec.metrics]
        rows = _sorted(frame[_present(frame, columns)], ["card", "model", "method"])
        # Under the names its rows give them (e.g. an image's base and CUDA variant).
        return rows.rename(columns={"model": spec.model, "method": spec.method})

    table.__doc__ = f"Every {kind} measurement: its settings and numbers."
    return table


def reproduced(ours: pd.Series, theirs: pd.Series, band: pd.Series) -> pd.Series:
    """"yes" where ours is within ``band`` of the paper's number, "no" where it is not, None
    where either is missing or the paper's number has no band (qerl/report/paper.csv)."""
    compared = ours.notna() & theirs.notna() & band.notna()
    verdict = ((ours - theirs).abs() <= band).map({True: "yes", False: "no"})
    return verdict.where(compared, None)


def _beside_paper(table: pd.DataFrame, paper: pd.DataFrame, metric: pd.Series,
                  ours: str, on: tuple = ()) -> pd.DataFrame:
    """``table`` with the paper's number of ``metric`` (a value per row) for the row's model
    and method (and columns ``on``, matched to the paper's of the same name), its band, and
    whether ``ours`` is within it ("reproduced")."""
    theirs = paper.assign(model=paper.model.map(paper_model))[
        ["model", "method", "metric", *on, "value", "band"]]
    keys = table.assign(model=table.model.map(paper_model), metric=metric.to_numpy())[
        ["model", "method", "metric", *on]]
    found = keys.merge(theirs, how="left", on=["model", "method", "metric", *on])
    table = table.assign(paper=found.value.to_numpy(), band=found.band.to_numpy())
    return table.assign(reproduced=reproduced(table[ours], table.paper, table.band))


def accuracy(frames: dict, paper: pd.DataFrame) -> pd.DataFrame:
    """pass@1 (%) of every trained policy and base model (and pass@k where k samples were
    drawn), beside it the paper's accuracy for the same model and method trained as the paper
    trained it (paper.csv's trained_on), its band and whether ours is within it."""
    ours = frames.get("eval")
    if ours is None:
        return pd.DataFrame()
    table = ours[_present(ours, ["model", "recipe", "method", "card", "bench", "problems",
                                 "samples"])].copy()
    table["ours"] = ours["pass@1"] * 100
    k = ours.samples.astype(int)
    table["pass@k"] = [row.get(f"pass@{n}") * 100 if n > 1 else None
                       for row, n in zip(ours.to_dict("records"), k, strict=True)]
    table = _beside_paper(table, paper.rename(columns={"trained_on": "recipe"}),
                          table.bench.map(PAPER_METRIC), "ours", on=("recipe",))
    table.insert(table.columns.get_loc("band") + 1, "delta", table.ours - table.paper)
    return _sorted(table, ["model", "recipe", "method", "bench"])


def external(frames: dict, paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """Base-model numbers from lm-eval and lighteval, as the paper took them."""
    ours = frames.get("external")
    if ours is None:
        return pd.DataFrame()
    return ours[_present(ours, ["model", "recipe", "method", "tool_version", "bench",
                                "shots", "metric", "value", "problems", "limit"])
                ].rename(columns={"method": "tool"})


def _mean(run: pd.DataFrame, column: str) -> float:
    return run.get(column, pd.Series(dtype=float)).mean()


def _first(run: pd.DataFrame, column: str):
    """A run's setting (the same on every step), or None where its runs lack the column."""
    return run.get(column, pd.Series([None])).iloc[0]


def training(frames: dict, paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """One line per run: its card, learning rate and rollout backend, steps, last reward
    and entropy, mean step time, rollout time and sampler/trainer mismatch, peak memory."""
    ours = frames.get("train")
    if ours is None:
        return pd.DataFrame()
    rows = []
    for (model, recipe, method), run in ours.groupby(["model", "recipe", "method"]):
        last = run.loc[run.step.idxmax()]
        rows.append({"model": model, "recipe": recipe, "method": method,
                     "card": run.card.iloc[0],
                     "learning rate": _first(run, "learning_rate_set"),
                     "backend": _first(run, "backend"),
                     "steps": int(run.step.max()), "reward (last)": last.get("reward"),
                     "entropy (last)": last.get("entropy"),
                     "step time (s, mean)": _mean(run, "step_time"),
                     "rollout (s, mean)": _mean(run, "time/rollout_s"),
                     "mismatch |d log p| (mean)": _mean(run, MISMATCH),
                     "peak GB": run.get("memory/peak_gb", pd.Series(dtype=float)).max()})
    return _sorted(pd.DataFrame(rows), ["model", "recipe", "method"])


def _spread(row: dict, name: str, values: pd.Series) -> None:
    row[f"{name} mean"] = values.mean()
    row[f"{name} std"] = values.std()


def _science_seeds(frames: dict) -> dict:
    """(model, variant) -> (its learning rate, cards, a frame of one row a seed: reward over
    the first and the last quarter of the steps and their difference (the growth), mean
    entropy over the steps, and each held-out benchmark's avg@k)."""
    steps, held_out = frames.get("science"), frames.get("held-out")
    if steps is None:
        return {}
    out = {}
    for (model, variant), runs in steps.groupby(["model", "recipe"]):
        last = runs.step.max()
        per_seed = pd.DataFrame({
            "reward (first quarter)": runs[runs.step <= 0.25 * last].groupby("method")
            .reward.mean(),
            "reward (last quarter)": runs[runs.step > 0.75 * last].groupby("method")
            .reward.mean(),
            "entropy (mean)": runs.groupby("method").entropy.mean(),
        })
        per_seed["reward growth"] = (per_seed["reward (last quarter)"]
                                     - per_seed["reward (first quarter)"])
        if held_out is not None:
            mine = held_out[(held_out.model == model) & (held_out.recipe == variant)]
            for metric in [c for c in mine.columns if c.startswith("avg@")]:
                for bench, part in mine[mine[metric].notna()].groupby("bench"):
                    per_seed[f"{bench} {metric}"] = part.set_index("method")[metric]
        rate = _first(runs, "learning_rate_set")
        out[model, variant] = (rate, sorted(set(runs.card.dropna())), int(last), per_seed)
    return out


def science(frames: dict, paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per variant of the study, over its seeds (mean and standard deviation): reward over
    the first and the last quarter of the steps and their difference (the growth), mean
    entropy over the steps, and each held-out benchmark's avg@k (with how many seeds)."""
    rows = []
    for (model, variant), (rate, cards, last, per_seed) in _science_seeds(frames).items():
        row = {"model": model, "variant": variant, "learning rate": rate,
               "card": ", ".join(cards), "seeds": len(per_seed), "steps": last}
        for name in per_seed.columns:
            _spread(row, name, per_seed[name].dropna())
            if " avg@" in name:
                row[f"{name} seeds"] = per_seed[name].notna().sum()
        rows.append(row)
    return pd.DataFrame(rows)


def science_contrasts(frames: dict, paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every two variants of the study trained at the same learning rate (the controls
    differ from a method by one thing at its rate): the difference of their reward growth
    and held-out avg@k, A - B over the seeds' means, with its standard error (Welch: each
    side's variance over its seeds) and the cards each side ran on (runs on other cards or
    code versions differ by more than their seeds do: results/science/README.md)."""
    seeds = _science_seeds(frames)
    rows = []
    for (model, a), (rate, cards_a, _, runs_a) in seeds.items():
        for (other, b), (rate_b, cards_b, _, runs_b) in seeds.items():
            if other != model or rate_b != rate or b <= a or rate is None:
                continue
            row = {"model": model, "learning rate": rate, "A": a, "B": b,
                   "card A": ", ".join(cards_a), "card B": ", ".join(cards_b)}
            for name in ["reward growth", *[c for c in runs_a.columns if " avg@" in c]]:
                if name not in runs_b.columns:
                    continue
                x, y = runs_a[name].dropna(), runs_b[name].dropna()
                row[f"{name} A - B"] = x.mean() - y.mean()
                row[f"{name} se"] = (x.var() / len(x) + y.var() / len(y)) ** 0.5
            rows.append(row)
    return _sorted(pd.DataFrame(rows), ["model", "learning rate", "A", "B"])


def entropy(frames: dict, paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """Mean token entropy by weight format: on each variant's own samples and on BF16's
    (with the paired difference), 95% bootstrap intervals."""
    ours = frames.get("entropy")
    if ours is None:
        return pd.DataFrame()
    return ours[_present(ours, ["model", "card", "method", "prompts", "tokens", "sigma",
                                "own_entropy", "own_low", "own_high", "shared_entropy",
                                "shared_minus_bf16", "diff_low", "diff_high"])
                ].rename(columns={"method": "weights"})


# The rollout tables' rows: the engine's settings, then LoRA rank, group and batch.
ROLLOUT_ORDER = ["card", "model", "fused", "kv_cache", "gen_len", "prompt_len", "lora_rank",
                 "group", "batch"]


def _beside_engine(rows: pd.DataFrame) -> pd.DataFrame:
    """vLLM's rows (no fused setting) beside the engine's as it runs (fused)."""
    vllm = rows.method.str.startswith("vllm-")
    return rows.assign(fused=rows.fused.where(~vllm, 1))


def rollout(frames: dict, paper: pd.DataFrame) -> pd.DataFrame:
    """Rollout tokens/s by weights (engine; hf-bf16 is Hugging Face generate, vllm-* vLLM)
    and KV cache format, NVFP4 and NF4 over BF16 and the engine over vLLM on the same
    weights and cache, each weights' fp8 cache over its BF16 one (``_over_base_cache``), each
    from one run, and the paper's qerl over LoRA at the same LoRA rank (its 7B number names
    none)."""
    if "rollout" not in frames:
        return pd.DataFrame()
    wide = _by_weights(frames, "rollout", "tok_per_s", "nvfp4/bf16",
                       more=[("nf4/bf16", "nf4", "bf16"),
                             *[(f"{w}/vllm", w, f"vllm-{w}") for w in ("bf16", "nvfp4")]],
                       rows=_beside_engine)
    wide = _over_base_cache(_beside_engine(frames.get(every("rollout"), frames["rollout"])),
                            wide, ["card", "model", *KINDS["rollout"].setting], "tok_per_s",
                            rate=True)
    ref = paper[paper.metric == "rollout_throughput"]
    by_rank = {(paper_model(r.model), r.method, r.lora_rank): r.value for r in ref.itertuples()}
    unranked = {(paper_model(r.model), r.method): r.value for r in ref.itertuples()
                if pd.isna(r.lora_rank)}

    def theirs(model: str, method: str, rank: float):
        return by_rank.get((paper_model(model), method, rank),
                           unranked.get((paper_model(model), method)))

    ratios = []
    for r in wide.itertuples():
        qerl, lora = theirs(r.model, "qerl", r.lora_rank), theirs(r.model, "lora", r.lora_rank)
        ratios.append(qerl / lora if qerl and lora else None)
    wide["paper qerl/lora"] = ratios
    wide = _over_unadapted(frames.get(every("rollout"), frames["rollout"]), wide)
    return _sorted(wide, ROLLOUT_ORDER)


UNADAPTED = "nvfp4/vllm-bf16 no LoRA"


def _over_unadapted(rows: pd.DataFrame, wide: pd.DataFrame) -> pd.DataFrame:
    """wide[UNADAPTED]: our NVFP4 with its adapter over vLLM's BF16 with none (rank 0) at
    the same card, model, shape and KV cache format, from one run (``run_ratio``): what
    LoRA costs vLLM at large batch is the bar for 4-bit weights carrying an adapter."""
    shape = ["card", "model", "batch", "group", "prompt_len", "gen_len", "kv_cache"]
    plain = rows[(rows.method == "vllm-bf16") & (rows.lora_rank == 0)]
    ours = rows[(rows.method == "nvfp4") & (rows.lora_rank > 0) & (rows.fused != 0)]
    if plain.empty or ours.empty:
        return wide
    keys = [*shape, "lora_rank", "fused"]
    paired = run_ratio(ours, plain, shape, "tok_per_s", keep=keys)
    return wide.merge(paired.rename(columns={"ratio": UNADAPTED}), on=keys, how="left")


def rollout_phases(frames: dict, paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """Where each rollout row's time goes, by weights: the time to the first token (the
    prefill and one sample, s) and a decode step's (ms), for the rows that measured them."""
    ours = frames.get("rollout")
    if ours is None or "first_token_s" not in ours:
        return pd.DataFrame()
    ours = _beside_engine(ours[ours.first_token_s.notna()])
    if ours.empty:
        return pd.DataFrame()
    index = ["card", "model", *KINDS["rollout"].setting]
    phases = [_wide(ours, index, "method", value).rename(
        columns=lambda c, unit=unit: c if c in index else f"{c} {unit}")
        for value, unit in (("first_token_s", "first token s"), ("step_ms", "step ms"))]
    return _sorted(phases[0].merge(phases[1], on=index), ROLLOUT_ORDER)


def _day_span(days: pd.Series) -> str:
    """The days a row's measurements were taken: "2026-11-28", or "2026-11-26 .. 2026-11-28"
    where its cells come from runs days apart (older code in some)."""
    days = days.dropna()
    if days.empty:
        return ""
    first, last = days.min(), days.max()
    return first if first == last else f"{first} .. {last}"


def _speedup_by_m(kind: str, index: list[str], method: str, doc: str,
                  value: str = "speedup_vs_bf16"):
    """A table of ``kind``'s ``value`` (speed-ups over cuBLAS BF16): a row per card, model,
    ``index`` and method (named ``method``), a column per M."""

    def table(frames: dict, paper: pd.DataFrame | None = None) -> pd.DataFrame:
        ours = frames.get(kind)
        if ours is None or value not in ours:
            return pd.DataFrame()
        keys = ["card", "model", *index, "method"]
        wide = _wide(ours, keys, "M", value)
        if "date" in ours:  # a row's cells can come from runs of other versions: say when
            day = pd.to_datetime(ours["date"], errors="coerce").dt.strftime("%Y-%m-%d")
            days = ours.assign(day=day)
            span = days.groupby(keys, dropna=False)["day"].agg(_day_span).rename("measured")
            wide = wide.merge(span.reset_index(), on=keys, how="left")
        columns = {"method": method, **{m: f"M={m}" for m in ours.M.unique()}}
        return _sorted(wide.rename(columns=columns), ["card", "model"])

    table.__doc__ = doc
    return table


kernels = _speedup_by_m("kernels", ["layer"], "op", "NVFP4 matmul speed-up over cuBLAS BF16 "
                        "by card, model, layer and op (fwd, bwd), a column per M.")
kernel_ceilings = _speedup_by_m(
    "kernels", ["layer"], "op", "What physics allows the NVFP4 matmul over cuBLAS BF16 on each "
    "card (collect.kernel_ceiling: its fewest bytes at the measured copy bandwidth or its "
    "multiply at cuBLAS's best rate, whichever is longer), laid out as the kernels table.",
    value="ceiling_vs_bf16")
kernel_paths = _speedup_by_m("kernel_paths", ["layer", "op"], "path",
                             "Each path of the NVFP4 matmul over cuBLAS BF16, a column per M: "
                             "where the fastest path changes is a crossover.")
token_tiles = _speedup_by_m("token_tiles", ["layer"], "token_tile",
                            "The Hopper GEMM over cuBLAS BF16 by token tile, a column per M: "
                            "what nvfp4_gemm.token_tile chooses from.")


# A decoder layer's projections in a decode step, as the kernels benchmark times them (q/k/v
# and gate/up side by side, as the step runs them).
STEP_PROJECTIONS = ("qkv", "o", "gate_up", "down")


def step_ceiling(frames: dict, wide: pd.DataFrame) -> pd.Series:
    """The most an NVFP4 decode step could run over BF16's (``wide``: a row per card, model
    and batch with BF16's step ms): BF16's step with every layer's projections at their
    ceiling (``kernel_ceilings``: the fewest bytes at the copy rate, or the multiply at
    cuBLAS's best rate) and every other part as it is. An estimate: the projections are
    charged cuBLAS's time alone at M = batch (the kernels benchmark), times the model's
    layers. NaN without BF16's step or a projection's time at that M."""
    kernels = frames.get("kernels")
    if kernels is None or "bf16" not in wide or "ceiling_vs_bf16" not in kernels:
        return pd.Series(float("nan"), index=wide.index)
    fwd = kernels[(kernels.method == "fwd") & kernels.layer.isin(STEP_PROJECTIONS)]
    saved_us = (fwd.bf16_us * (1 - 1 / fwd.ceiling_vs_bf16)).groupby(
        [fwd.card, fwd.model, fwd.M]).sum(min_count=len(STEP_PROJECTIONS))  # NaN: one missing
    at = pd.MultiIndex.from_arrays([wide.card, wide.model, wide.batch])
    known = set(archs.known())
    layers = wide.model.map({m: archs.fields(m)["num_hidden_layers"]
                             for m in set(wide.model) & known})
    saved_ms = saved_us.reindex(at).to_numpy() * layers / 1e3
    return wide.bf16 / (wide.bf16 - saved_ms)


def decode_step(frames: dict, paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """One rollout decode step (ms, a CUDA-graph replay) by weights and KV cache format,
    NVFP4's speed over BF16 in the same run and the most the card would allow it
    (``step_ceiling``), each weights' speed with an fp8 cache over its own with BF16's in
    the same run (``_over_base_cache``), and where measured the time the step spends
    outside its kernels (the replay less the time a kernel runs, overlaps counted once:
    "WEIGHTS between kernels ms"; the kernels' plain sum, recorded before, would count a
    side stream's kernels twice)."""
    ours = frames.get("decode_step")
    if ours is None:
        return pd.DataFrame()
    wide = _by_weights(frames, "decode_step", "step_ms", "bf16/nvfp4")
    wide["ceiling bf16/nvfp4"] = step_ceiling(frames, wide)
    index = ["card", "model", *KINDS["decode_step"].setting]
    wide = _over_base_cache(frames.get(every("decode_step"), ours), wide, index, "step_ms",
                            rate=False)
    if "busy_ms" in ours:
        # Both recorded to the microsecond: so is their difference.
        between = _wide(ours.assign(between=(ours.step_ms - ours.busy_ms).round(3)), index,
                        "method", "between")
        between = between.rename(columns={w: f"{w} between kernels ms"
                                           for w in between.columns if w not in index})
        wide = wide.merge(between, on=index, how="left")
    return _sorted(wide, ["card", "model", "fused", "kv_cache", "batch"])


STEP_PARTS = ("matmul_ms", "lora_ms", "attention_ms", "norm_ms", "other_ms")


def decode_step_parts(frames: dict, paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """Where a decode step's kernel time goes, for the steps whose kernels were summed by
    part (qerl/bench/decode_step.py's PARTS: an eager step profiled), beside its replay's
    time, the sampling of its tokens after it (not in the replay), and a prefill of as
    many sequences: its time and the time some kernel of it runs."""
    ours = frames.get("decode_step")
    if ours is None or "matmul_ms" not in ours:
        return pd.DataFrame()
    rows = ours[ours.matmul_ms.notna()].rename(columns={"method": "weights"})
    columns = ["card", "model", "weights", *KINDS["decode_step"].setting, "step_ms",
               *STEP_PARTS, "sampling_ms", "prefill_len", "prefill_ms", "prefill_busy_ms"]
    return _sorted(rows[_present(rows, columns)], ["card", "model", "fused", "kv_cache",
                                                   "batch"])


def efficiency(frames: dict, paper: pd.DataFrame) -> pd.DataFrame:
    """One RL step per model, method and settings: each phase's time, the step's time
    against LoRA's from the same run (``collect.speed_vs_lora``), the paper's end-to-end
    speed against LoRA with its band and whether ours is within it, rollout tokens/s and peak
    memory (runs out of memory: the peak they reached)."""
    ours = frames.get("step")
    if ours is None:
        return pd.DataFrame()
    table = _beside_paper(ours, paper, pd.Series("end_to_end_speed", index=ours.index),
                          "speed_vs_lora").rename(columns={"paper": "paper speed vs lora"})
    columns = ["card", "date", "model", "method", *KINDS["step"].setting, "status",
               *[f"{p}_s" for p in PHASES], "step_s", "speed_vs_lora", "paper speed vs lora",
               "band", "reproduced", "rollout_tok_per_s", "peak_gb", "cores", "threads"]
    return _sorted(table[_present(table, columns)],
                   ["card", "completion", "prompts", "grad_ckpt", "micro_batch", "model",
                    "method"])


def fits(frames: dict, paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """Which model fits which budget (`qerl bench budget`): a row per card, kernel
    architecture, step (prompts x completions x tokens, LoRA rank, a KV cache other than
    BF16), model and method, a column per budget. A cell is the step's time against the same
    model and method's on the whole card, where it ran within the budget as the driver
    counts it ("1.21x"); else why not: the smallest budget its plan needs ("needs 9.13
    GB"), torch's cap reached ("oom"), the driver's peak past the budget ("over: 8.42 GB"),
    or "failed"; after a step that ran, the memory measures its plan took, if any ("1.21x
    (offload.embedding)")."""
    rows = frames.get("budget")
    if rows is None or "status" not in rows:
        return pd.DataFrame()
    rows = rows[rows.whole_card != 1]

    def outcome(r) -> str:
        if r.status == "ok":
            return f"{r.time_vs_uncapped:.2f}x" if pd.notna(r.time_vs_uncapped) else "ok"
        if r.status == "refused":
            return f"needs {r.needs_gb:.2f} GB"
        if r.status == "over":
            return f"over: {r.nvml_peak_gb:.2f} GB"
        return r.status

    def cell(r) -> str:
        taken = getattr(r, "measures", None)  # rows before the measures have none
        if r.status == "refused" or not isinstance(taken, str) or taken == "none":
            return outcome(r)
        return f"{outcome(r)} ({taken.replace('+', ', ')})"

    step = (rows.prompts.map("{:g}".format) + "x" + rows.generations.map("{:g}".format)
            + "x" + rows.completion.map("{:g}".format) + " r" + rows.lora_rank.map("{:g}".format)
            + rows.kv_cache.map(cache_label))
    rows = rows.assign(step=step, budget=rows.memory_gb.map("{:g} GB".format),
                       cell=[cell(r) for r in rows.itertuples()])
    index = ["card", "kernel_arch", "step", "model", "method"]
    budgets = sorted(set(rows.budget), key=lambda b: float(b.split()[0]))
    wide = _wide(rows, index, "budget", "cell").fillna({b: "" for b in budgets})  # not run
    return _sorted(wide[[*index, *budgets]], index)


# The settings the headline quotes: the rollout of the paper's 7B figure at the batch
# sizes RL samples (in the BF16 KV cache, ours' and vLLM's default: an fp8 one is its own
# claim), and the layers that hold most of a model's weights.
HEADLINE_ROLLOUT = {"model": "qwen2.5-7b", "lora_rank": 32, "prompt_len": 256,
                    "gen_len": 1024, "fused": 1, "kv_cache": BASE_CACHE}
HEADLINE_KERNELS = {"models": ("qwen2.5-7b", "qwen2.5-32b"), "layers": ("gate_up", "down"),
                    "m": (1, 64, 128, 256, 2048)}


def headline(frames: dict, paper: pd.DataFrame) -> pd.DataFrame:
    """The claims, a line each with the setting it holds at (batch, rows, completions a
    step) and the card, taken from the tables beside it: rollout tokens/s of NVFP4 over
    BF16 and over vLLM on the same weights (7B, LoRA r32, prompt 256, 1024 generated), one
    RL step of qerl over LoRA, the NVFP4 matmul over cuBLAS BF16 (7B and 32B gate_up and
    down, forward, beside the most the card allows it: ``kernel_ceilings``), and the largest
    RL step that ran on one card."""
    return _claims(frames, paper).drop(columns=["at"], errors="ignore")


def status(frames: dict, paper: pd.DataFrame) -> pd.DataFrame:
    """The headline's claims in a line per claim and card (the README's first table): the
    settings where a speed-up holds (at least 1x) and those where it does not, in the order
    measured, and its range; for the largest RL step, the step and its peak memory."""
    claims = _claims(frames, paper)
    if claims.empty:
        return pd.DataFrame()
    rows = []
    for (claim, card), part in claims.groupby(["claim", "card"], sort=False):
        low, high, unit = part.value.min(), part.value.max(), part.unit.iloc[0]
        ratio = unit == "x"
        holds = part.value >= 1 if ratio else pd.Series(True, index=part.index)
        rows.append({"claim": claim, "card": card,
                     "holds (>= 1x) at": _settings(part.loc[holds, "at"]),
                     "does not (< 1x) at": _settings(part.loc[~holds, "at"]),
                     "range": (f"{low:.2f}-{high:.2f}x" if low != high else f"{low:.2f}x")
                     if ratio else f"{high:.1f} {unit}",
                     "table": part.table.iloc[0]})
    return pd.DataFrame(rows)


def _settings(at: pd.Series) -> str:
    """(label, value) pairs as 'label v1, v2; other w1', labels in the order first seen."""
    values: dict[str, list[str]] = {}
    for label, value in at:
        values.setdefault(label, []).append(value)
    return "; ".join(f"{label} {', '.join(v)}".strip() for label, v in values.items())


def _claims(frames: dict, paper: pd.DataFrame) -> pd.DataFrame:
    """The headline's rows, each with ``at``: the setting that varies along a claim, as a
    (label, value) pair (e.g. ("batch", "16")), for ``status``."""
    rows = []

    def add(claim, card, setting, value, unit, source, paper_value=None, ceiling=None,
            at=("", "")):
        if pd.notna(value):
            rows.append({"claim": claim, "card": card, "setting": setting,
                         "value": value, "unit": unit, "paper": paper_value,
                         "ceiling": ceiling, "table": source, "at": at})

    roll = rollout(frames, paper)
    if not roll.empty:
        chosen = roll[(roll[list(HEADLINE_ROLLOUT)] == pd.Series(HEADLINE_ROLLOUT)).all(axis=1)]
        for _, r in chosen.iterrows():
            setting = (f"{r.model}, LoRA r{r.lora_rank:g}, batch {r.batch:g}"
                       + (f" ({r.group:g} samples a prompt)" if r.group != 1 else "")
                       + f", prompt {r.prompt_len:g} / {r.gen_len:g} generated")
            at = ("batch", f"{r.batch:g}" + (f" (G={r.group:g})" if r.group != 1 else ""))
            add("rollout tokens/s, NVFP4 / BF16", r.card, setting, r.get("nvfp4/bf16"), "x",
                "rollout.md", r.get("paper qerl/lora"), at=at)
            for weights, name in (("nvfp4", "NVFP4"), ("bf16", "BF16")):
                add(f"rollout tokens/s, ours / vLLM ({name})", r.card, setting,
                    r.get(f"{weights}/vllm"), "x", "rollout.md", at=at)
            add("rollout tokens/s, ours NVFP4 + LoRA / vLLM BF16 without", r.card, setting,
                r.get(UNADAPTED), "x", "rollout.md", at=at)
    step = efficiency(frames, paper)
    ours = frames.get("step")
    if ours is not None and "device" in ours:  # the paper's claims are a GPU's: a CPU's aside
        step = step[~step.card.isin(ours.card[ours.device == "cpu"])]
    if not step.empty:
        for _, r in step[step.method == "qerl"].iterrows():
            setting = (f"{r.model}, {r.prompts:g} prompts x {r.generations:g} x "
                       f"{r.completion:g} tokens, LoRA r{r.lora_rank:g}"
                       + (", gradient checkpointing" if r.get("grad_ckpt") else ""))
            add("RL step, LoRA time / qerl time", r.card, setting, r.speed_vs_lora, "x",
                "efficiency.md", r.get("paper speed vs lora"),
                at=(r.model, f"{r.prompts:g}x{r.generations:g}x{r.completion:g}"))
        ok = step.status == "ok" if "status" in step else True  # older rows: no status
        ran = step[(step.method == "qerl") & ok]
        for card, part in ran.groupby("card"):
            biggest = part.loc[_by_size(part.model).idxmax()]
            add("largest qerl RL step on one card", card,
                f"{biggest.model}, {biggest.prompts:g} x {biggest.generations:g} x "
                f"{biggest.completion:g} tokens", biggest.get("peak_gb"), "GB peak",
                "efficiency.md", at=(biggest.model, f"{biggest.prompts:g}x"
                                     f"{biggest.generations:g}x{biggest.completion:g}"))
    matmul = kernels(frames, paper)
    if not matmul.empty:
        keys = ["card", "model", "layer", "op"]
        bounds = kernel_ceilings(frames, paper)
        bounds = {tuple(b[keys]): b for _, b in bounds.iterrows()} if len(bounds) else {}
        chosen = matmul[matmul.model.isin(HEADLINE_KERNELS["models"])
                        & matmul.layer.isin(HEADLINE_KERNELS["layers"]) & (matmul.op == "fwd")]
        for _, r in chosen.iterrows():
            bound = bounds.get(tuple(r[keys]), {})
            for m in HEADLINE_KERNELS["m"]:
                add("NVFP4 matmul / cuBLAS BF16 (speed)", r.card,
                    f"{r.model} {r.layer}, forward, M = {m} rows", r.get(f"M={m}"), "x",
                    "kernels.md", ceiling=bound.get(f"M={m}"),
                    at=(f"{r.model} {r.layer} M", f"{m}"))
    return pd.DataFrame(rows)


# Ours beside the paper's rollout speed-ups (paper.csv): its tokens/s by LoRA rank are tens
# a second at 14B and 32B, one sequence decoding, so ours at batch 1 (the headline's prompt
# length, every prompt its own, the engine as it runs in its default BF16 KV cache).
PAPER_ROLLOUT = {"batch": 1, "group": 1, "prompt_len": HEADLINE_ROLLOUT["prompt_len"],
                 "fused": 1, "kv_cache": BASE_CACHE}
# The paper's numbers and what of ours each is compared with: (our table, how the paper's
# number is compared).
PAPER_COMPARED = {"gsm8k_accuracy": (accuracy, "pass@1 %"),
                  "math500_accuracy": (accuracy, "pass@1 %"),
                  "rollout_throughput": (rollout, "tokens/s over LoRA's"),
                  "end_to_end_speed": (efficiency, "RL step speed over LoRA's")}
# Our rollout weights for each of the paper's methods.
WEIGHTS_OF = {method: weights for weights, method in ROLLOUT_METHOD.items()}


def _ours_for(theirs, tables: dict, paper: pd.DataFrame) -> tuple[float, pd.DataFrame]:
    """The paper's number ``theirs`` (a row of paper.csv) as compared (rollout: over its
    LoRA's at the same rank), and the rows of our tables compared with it: ours, card,
    setting, reproduced."""
    build, _ = PAPER_COMPARED[theirs.metric]
    table = tables[build]
    if table.empty:
        return theirs.value, pd.DataFrame()
    mine = table[table.model.map(paper_model) == paper_model(theirs.model)]
    compared = theirs.value
    if build is rollout:
        lora = paper[(paper.metric == theirs.metric) & (paper.method == "lora")
                     & (paper.model == theirs.model) & (paper.lora_rank == theirs.lora_rank)]
        compared = theirs.value / lora.value.iloc[0] if len(lora) else float("nan")
        mine = mine[(mine[list(PAPER_ROLLOUT)] == pd.Series(PAPER_ROLLOUT)).all(axis=1)
                    & (mine.lora_rank == theirs.lora_rank)]
        ours = mine.get(f"{WEIGHTS_OF[theirs.method]}/bf16",
                        pd.Series(float("nan"), index=mine.index))
        setting = [f"batch {r.batch:g}, prompt {r.prompt_len:g} / {r.gen_len:g} generated"
                   for r in mine.itertuples()]
        verdict = reproduced(ours, pd.Series(compared, index=mine.index),
                             pd.Series(theirs.band, index=mine.index))
    elif build is accuracy:
        mine = mine[(mine.method == theirs.method) & mine.paper.notna()
                    & (mine.bench.map(PAPER_METRIC) == theirs.metric)]
        ours, verdict = mine.ours, mine.reproduced
        setting = [f"trained on {r.recipe}, {r.bench}" for r in mine.itertuples()]
    else:
        mine = mine[(mine.method == theirs.method) & mine["paper speed vs lora"].notna()]
        ours, verdict = mine.speed_vs_lora, mine.reproduced
        setting = [f"{r.prompts:g} prompts x {r.generations:g} x {r.completion:g} tokens, "
                   f"LoRA r{r.lora_rank:g}" for r in mine.itertuples()]
    found = pd.DataFrame({"ours": ours.to_numpy(), "card": mine.card.to_numpy(),
                          "setting": setting, "reproduced": verdict.to_numpy()})
    return compared, found[found.ours.notna()]


def paper_comparisons(frames: dict, paper: pd.DataFrame) -> pd.DataFrame:
    """Every number of the paper (paper.csv), as compared (``PAPER_COMPARED``), beside ours:
    a row for each of our measurements of it (one on each card, say), "reproduced" yes or no
    (within its band); one row "not measured" where we have none, "not compared" where the
    paper's number has no band."""
    tables = {build: build(frames, paper) for build in {b for b, _ in PAPER_COMPARED.values()}}
    rows = []
    for r in paper.itertuples():
        _, unit = PAPER_COMPARED[r.metric]
        name = {"model": r.model, "metric": r.metric, "method": r.method,
                "lora_rank": r.lora_rank, "compared": unit}
        if pd.isna(r.band):
            rows.append({**name, "paper": r.value, "reproduced": "not compared"})
            continue
        theirs, found = _ours_for(r, tables, paper)
        if found.empty:
            rows.append({**name, "paper": theirs, "band": r.band, "reproduced": "not measured"})
        rows += [{**name, "paper": theirs, "band": r.band, **mine}
                 for mine in found.to_dict("records")]
    columns = ["model", "metric", "method", "lora_rank", "compared", "paper", "band", "ours",
               "card", "setting", "reproduced"]
    return pd.DataFrame(rows).reindex(columns=columns)


def versus_paper(frames: dict, paper: pd.DataFrame) -> pd.DataFrame:
    """``paper_comparisons``, where any of ours is compared with the paper's."""
    table = paper_comparisons(frames, paper)
    return table if table.ours.notna().any() else pd.DataFrame()


BUILT = {
    "status": status, "headline": headline, "accuracy": accuracy, "external": external,
    "training": training,
    "science": science, "science_contrasts": science_contrasts,
    "entropy": entropy, "rollout": rollout, "rollout_phases": rollout_phases,
    "kernels": kernels, "kernel_ceilings": kernel_ceilings, "kernel_paths": kernel_paths,
    "token_tiles": token_tiles,
    "decode_step": decode_step, "decode_step_parts": decode_step_parts,
    "efficiency": efficiency, "versus_paper": versus_paper, "fits": fits,
}
# Every table: those built above, and for each benchmark registered without one, the
# listing of its rows (qerl.bench.registry).
TABLES = {**BUILT, **{b.table: listing(b.name) for b in BENCHMARKS if b.table not in BUILT}}
