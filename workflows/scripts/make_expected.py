"""Write the expected values of the gpu and rehearsal configurations from our committed runs
of them (results/gpu, results/rehearsal): workflows/expected/CONFIG.csv (what any card should
reproduce) and CONFIG-CARD.csv (speeds and job times, on the card model we ran on), each
tolerance beside the evidence for it, taken from the committed results through qerl report.

    python workflows/scripts/make_expected.py    # after committing a new run of either

The tolerances' rules are the constants below; tests/report/test_expected_values.py checks
that the committed files are what this script makes of the committed results.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import yaml

from qerl.report.check import RUN_RECORD, JobTimes
from qerl.report.collect import Results, collect
from qerl.report.expected import CARD, JOB, card_file, format_expected
from qerl.report.tables import science

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
EXPECTED = ROOT / "workflows" / "expected"
CONFIGS = ("gpu", "rehearsal")

SPREADS = 3  # a noisy number may move this many of its measured spreads
SPEED_FLOOR = 0.8  # a speed on one card model: at least this fraction of ours
MEMORY_CEILING = 1.1  # peak memory: at most this multiple of ours
JOB_CEILING = 3.0  # a job's wall time: at most this multiple of ours
EXACT = 1e-6  # what random weights give exactly (no answer right), as in smoke.csv

# The tables' note of a configuration: what its values mean.
NOTES = {"rehearsal": (
    "Rehearsal: Qwen2.5 shapes with random weights for a few steps, so accuracy 0 and "
    "reward 0 (GSM8K) or -1 (BigMath: DAPO's overlong penalty, as a random model never "
    "stops) are what it should show; its numbers are the jobs' times (run.json) and the "
    "benchmarks'.")}


def _config(name: str) -> dict:
    return yaml.safe_load((ROOT / "workflows" / "config" / f"{name}.yaml").read_text())


def _say(*parts: str) -> str:
    """One paragraph of a file's comments from ``parts`` (wrapped when written)."""
    return " ".join(parts)


def _rows(frame: pd.DataFrame, tolerance, bound: str = "band") -> pd.DataFrame:
    return pd.DataFrame({"key": frame.key, "value": frame.value,
                         "tolerance": tolerance, "bound": bound})


def _pick(values: pd.DataFrame, kind: str, metrics) -> pd.DataFrame:
    return values[(values.kind == kind) & values.metric.isin(metrics)]


def _any_card(rows: pd.DataFrame) -> pd.DataFrame:
    """Measurements whose value does not depend on the card: their keys with {card}."""
    return rows.assign(key=[key.replace(f"/{card}/", f"/{CARD}/")
                            for key, card in zip(rows.key, rows.card, strict=True)])


def _windows(values: pd.DataFrame, metric: str, windows) -> pd.DataFrame:
    """Each training run's mean ``metric`` over each window ``windows(last step)`` gives,
    keyed train/MODEL/RECIPE/METHOD/stepA-B/METRIC."""
    steps = values[(values.kind == "train") & (values.metric == metric)]
    steps = steps.assign(step=steps.bench.str.removeprefix("step").astype(int))
    rows = []
    for (model, recipe, method), run in steps.groupby(["model", "recipe", "method"]):
        for first, last in windows(run.step.max()):
            inside = run[run.step.between(first, last)]
            rows.append({"key": f"train/{model}/{recipe}/{method}/step{first}-{last}/{metric}",
                         "value": inside.value.mean(), "card": run.card.iloc[0]})
    return pd.DataFrame(rows)


def _quarters(last: int) -> list[tuple[int, int]]:
    """The first and last quarter of a run's steps, as tables.science takes them."""
    return [(1, math.floor(0.25 * last)), (math.floor(0.75 * last) + 1, last)]


def _whole(last: int) -> list[tuple[int, int]]:
    return [(1, last)]


# ---- the evidence: spreads measured in our committed runs ---------------------------------

class Evidence:
    """What our committed runs say about run-to-run spread, each number with where it is
    from (the study, pairs of runs of one measurement)."""

    def __init__(self, top: Results, runs: dict[str, Results]):
        self.top, self.runs = top, runs
        study = science(top.frames)
        rates = _config("gpu")["train"]["learning_rates"]
        variants = _config("science")["science"]["variants"]
        # The study's arm at the gpu configuration's learning rates, each variant's seeds
        # all on one card model: seeds of one setting, apart only by their seed.
        arm = [name for name, v in variants.items()
               if rates.get(v["method"]) == v["learning_rate"] and set(v) <= {
                   "method", "learning_rate", "aqn"}]
        self.arm = study[study.variant.isin(arm) & ~study.card.str.contains(",")]
        held_out = top.frames["held-out"]
        self.held_out_problems = int(held_out.problems.max())

    def seed_std(self, column: str) -> float:
        return float(self.arm[f"{column} std"].max())

    def held_out_spread(self) -> float:
        """The largest seed standard deviation of a held-out accuracy in the arm, in
        standard errors of a proportion over its problems."""
        ratios = []
        for column in [c for c in self.arm if c.endswith(" mean") and " avg@" in c]:
            p = self.arm[column]
            ratios += list(self.arm[column.replace(" mean", " std")]
                           / (p * (1 - p) / self.held_out_problems) ** 0.5)
        return float(max(ratios))

    def arm_names(self) -> str:
        cards = ", ".join(sorted(set(self.arm.card)))
        return f"{', '.join(self.arm.variant)}: {int(self.arm.seeds.min())} seeds each, {cards}"

    def _pair(self, a: Results, b: Results, kind: str, metrics) -> pd.DataFrame:
        """The numbers of ``kind`` measured in both ``a`` and ``b`` (keys alike but for the
        card): value_a, value_b."""
        left, right = (_any_card(_pick(r.values, kind, metrics)) for r in (a, b))
        return left.merge(right, on="key", suffixes=("_a", "_b"))

    def fidelity_diff(self, metric: str) -> float:
        both = self._pair(self.top, self.runs["gpu"], "fidelity", [metric])
        return float((both.value_a - both.value_b).abs().max())

    def base_eval_gap(self) -> float:
        """Our two evaluations of SmolLM2's BF16 base on GSM8K (an H100's in results/eval,
        the gpu run's): their difference in standard errors."""
        top = self.top.values.set_index("key").value
        gpu = self.runs["gpu"].values.set_index("key").value
        a = top["eval/smollm2-135m-instruct/base-h100/bf16/gsm8k/pass@1"]
        b = gpu["eval/smollm2-135m-instruct/base/bf16/gsm8k/pass@1"]
        n = int(self.runs["gpu"].frames["eval"].problems.max())
        return abs(a - b) / (2 * b * (1 - b) / n) ** 0.5

    def speed_spread(self) -> tuple[float, int]:
        """The largest relative difference of a kernel's speed-up measured in two of our
        runs on one card model (rehearsal's and gpu's), and how many were measured twice."""
        both = self._pair(self.runs["rehearsal"], self.runs["gpu"], "kernels",
                          ["speedup_vs_bf16"])
        return float((both.value_a / both.value_b - 1).abs().max()), len(both)

    def memory_agreement(self) -> tuple[int, int]:
        """Of the rollout and RL-step peaks measured at one setting on two card models
        (results/), how many are within MEMORY_CEILING of each other."""
        peaks = self.top.values[self.top.values.kind.isin(["rollout", "step"])
                                & (self.top.values.metric == "peak_gb")]
        both = _any_card(peaks).groupby("key").value.agg(["min", "max", "count"])
        both = both[both["count"] == 2]
        return int((both["max"] <= MEMORY_CEILING * both["min"]).sum()), len(both)

    def job_ratio(self) -> float:
        """The largest ratio of one job's two wall times: the rehearsal's benchmarks, run
        twice on one card model (results/rehearsal/README.md)."""
        first = JobTimes.read(RESULTS / "rehearsal").seconds
        again = json.loads((RESULTS / "rehearsal" / "run-benchmarks-rerun.json").read_text())
        return max(max(first[j], s) / min(first[j], s) for j, s in again["jobs_s"].items()
                   if j.startswith("bench/"))


# ---- the sections of each file ------------------------------------------------------------

def _problems(found: Results, values: pd.DataFrame, cfg: dict) -> pd.Series:
    """The number of problems behind each accuracy of ``values`` (eval and external, of
    ``found``): the summary's, else the tool's limit, else the benchmark file's lines."""
    counts = {}
    for kind in ("eval", "external"):
        frame = found.frames.get(kind)
        if frame is None:
            continue
        for row in frame.to_dict("records"):
            n = row.get("problems")
            if pd.isna(n):
                n = row.get("limit")
            if pd.isna(n):
                path = ROOT / cfg["data"][row["bench"]]
                n = sum(1 for line in path.read_text().splitlines() if line.strip())
            counts[(kind, row["model"], row["recipe"], row["method"], row["bench"])] = n
    return pd.Series([counts[(r.kind, r.model, r.recipe, r.method, r.bench)]
                      for r in values.itertuples()], index=values.index, dtype=float)


def _accuracy(found: Results, cfg: dict, random: bool, ev: Evidence) -> tuple:
    values = found.values[found.values.kind.isin(["eval", "external"])]
    values = values[(values.kind == "external") | values.metric.isin(["pass@1", "pass@2"])]
    what = _say("Accuracies (our evaluations' pass@1 and pass@2, lm-eval's and lighteval's",
                "base numbers):")
    if random:
        return _say(what, f"random weights answer nothing, so 0 within {EXACT}."), \
            _rows(values, EXACT)
    n = _problems(found, values, cfg)
    p = values.value.clip(lower=1 / n, upper=1 - 1 / n)
    spread = max(1.0, ev.held_out_spread())
    tolerance = (SPREADS * spread * (p * (1 - p) / n) ** 0.5).round(4)
    return _say(
        what, f"within {SPREADS} standard errors of a proportion over the benchmark's n",
        "problems, sqrt(p (1 - p) / n) at our p (taken as at least 1/n). No run of this",
        "configuration was repeated; what our runs say of the spread: the study's seeds at",
        f"this configuration's learning rates ({ev.arm_names()}; results/tables/science.csv)",
        f"spread their held-out accuracies by at most {ev.held_out_spread():.2f} of such",
        "standard errors, and this model's base evaluation on GSM8K on an H100",
        "(results/eval/smollm2-135m-instruct/base-h100) and in this run differ by",
        f"{ev.base_eval_gap():.2f} standard errors of their difference."), \
        _rows(values, tolerance)


def _rewards(found: Results, random: bool, ev: Evidence) -> list[tuple]:
    values = found.values
    if random:
        steps = _pick(values, "train", ["reward"])
        entropy = _pick(values, "train", ["entropy"])
        spread = entropy.groupby("model").value.agg(lambda v: v.max() - v.min())
        return [(_say("Rewards, step by step: random weights earn exactly their floor (0 on",
                      f"GSM8K, -1 on BigMath), within {EXACT}."), _rows(steps, EXACT)),
                (_say("Entropy, step by step: a random model's is near the log of its",
                      f"vocabulary; within {SPREADS} times the spread of that model's runs",
                      "(every method and step) in this run:",
                      ", ".join(f"{m} {s:.2g}" for m, s in spread.items()) + ".",
                      "Its runs on 4-bit and BF16 weights agree this closely: another card's",
                      "arithmetic moves it less than another weight format does."),
                 _rows(entropy, SPREADS * entropy.model.map(spread).round(6)))]
    rewards = _windows(values, "reward", _quarters)
    first, last = ev.seed_std("reward (first quarter)"), ev.seed_std("reward (last quarter)")
    tolerance = SPREADS * rewards.key.str.contains("/step1-").map({True: first, False: last})
    entropy = _windows(values, "entropy", _whole)
    return [(_say(
        "Rewards: each run's mean over the first and the last quarter of its steps (one",
        f"step's is too noisy to check), within {SPREADS} times the largest standard",
        "deviation over seeds of that quarter's mean in the study's arm at these learning",
        f"rates ({ev.arm_names()}): first quarter {first:.4f}, last {last:.4f}",
        "(results/tables/science.csv)."), _rows(rewards, tolerance.round(4))),
        (_say(f"Entropy: each run's mean over its steps, within {SPREADS} times the largest",
              "standard deviation over seeds of that mean in the same arm:",
              f"{ev.seed_std('entropy (mean)'):.4f}."),
         _rows(entropy, round(SPREADS * ev.seed_std("entropy (mean)"), 4)))]


def _fidelity(found: Results, ev: Evidence) -> list[tuple]:
    values = _pick(found.values, "fidelity", ["top1_agreement", "mean_kl_nats"])
    if values.empty:
        return []
    diffs = {m: ev.fidelity_diff(m) for m in ("top1_agreement", "mean_kl_nats")}
    return [(_say(
        "Quantization fidelity, measured on the host's CPU (so {card}: any card): within",
        f"{SPREADS} times the largest difference between our two runs of it on two CPUs",
        "(results/bench and this run):",
        ", ".join(f"{m} {d:.4g}" for m, d in diffs.items()) + "."),
        _rows(_any_card(values), SPREADS * values.metric.map(diffs)))]


def _memory(found: Results, ev: Evidence) -> tuple:
    values = found.values
    measured = pd.concat([_pick(values, "memory", ["weights_gb", "build_peak_gb"]),
                          _pick(values, "rollout", ["peak_gb"]),
                          _pick(values, "step", ["peak_gb"])])
    rows = pd.concat([_any_card(measured)[["key", "value"]],
                      _windows(values, "memory/peak_gb", _whole)[["key", "value"]]])
    within, pairs = ev.memory_agreement()
    return _say(
        f"Peak memory (GB): a ceiling at {MEMORY_CEILING} times ours (a training run's: its",
        "mean peak over its steps), on any card ({card}): the allocator's peaks follow the",
        f"code more than the card. In results/, {within} of the {pairs} rollout and RL-step",
        "peaks measured at one setting on two card models are within",
        f"{MEMORY_CEILING} times each other."), \
        _rows(rows, ((MEMORY_CEILING - 1) * rows.value).round(4), "ceiling")


def _speeds(found: Results, ev: Evidence) -> tuple:
    values = found.values
    step = _pick(values, "step", ["speed_vs_lora"])
    floors = pd.concat([_pick(values, "kernels", ["speedup_vs_bf16"]),
                        _pick(values, "rollout", ["tok_per_s"]),
                        step[step.method != "lora"]])  # LoRA's is 1 by definition
    times = _pick(values, "decode_step", ["step_ms"])
    spread, pairs = ev.speed_spread()
    return _say(
        "Speeds on this card model: kernels' speed-ups over cuBLAS BF16, rollout tokens/s",
        f"and the RL step's speed over LoRA's at least {SPEED_FLOOR} of ours (a floor), a",
        f"decode step's time at most ours / {SPEED_FLOOR} (a ceiling). Of the {pairs}",
        "kernel speed-ups measured in two of our runs on this card model (results/rehearsal,",
        f"results/gpu), none differs by more than {spread:.1%}; the rest is room for another",
        "host's clocks, power limit and neighbours."), pd.concat([
            _rows(floors, ((1 - SPEED_FLOOR) * floors.value).round(4), "floor"),
            _rows(times, ((1 / SPEED_FLOOR - 1) * times.value).round(4), "ceiling")])


def _jobs(results: Path, ev: Evidence) -> tuple:
    jobs = JobTimes.read(results)
    rows = pd.DataFrame({"key": [JOB + name for name in jobs.seconds],
                         "value": list(jobs.seconds.values())})
    return _say(
        f"Job wall times (s, {RUN_RECORD}): a generous ceiling at {JOB_CEILING:g} times ours.",
        "The rehearsal's benchmarks, run twice on one card model, took at most",
        f"{ev.job_ratio():.2f} times as long one time as the other; jobs that share a GPU",
        "(gpu_jobs) also wait on each other, and a host's disk and CPUs set every job's",
        "start-up."), _rows(rows, ((JOB_CEILING - 1) * rows.value).round(1), "ceiling")


def files(name: str, ev: Evidence) -> dict[Path, str]:
    """The expected files of configuration ``name`` and their text."""
    cfg = _config(name)
    results = ROOT / cfg["results_dir"]
    found = ev.runs[name]
    record = json.loads((results / RUN_RECORD).read_text())
    card = JobTimes.card_of(record["card"])
    random = all(str(source).startswith("arch:") for source in cfg["models"].values())
    expected = EXPECTED / f"{name}.csv"
    on_card = card_file(expected, card)
    source = _say("Made by workflows/scripts/make_expected.py from our run in",
                  f"{cfg['results_dir']} ({RUN_RECORD}: {record['card']}, commit",
                  f"{record['commit'][:12]}); regenerate it after committing a new run.")
    columns = _say("Columns: qerl/report/expected.py ({card}: on whichever card; stepA-B:",
                   "the mean of those steps; bound band: within tolerance either way,",
                   "floor: at most it below ours, ceiling: at most it above).")
    anywhere = [_accuracy(found, cfg, random, ev), *_rewards(found, random, ev),
                *_fidelity(found, ev), _memory(found, ev)]
    return {
        expected: format_expected(
            [_say(f"What workflows/config/{name}.yaml should reproduce on any card (qerl",
                  "report --check; its runs check themselves). Speeds and job times depend",
                  f"on the card model: {on_card.name} beside this file holds ours; on a card",
                  "with no such file they are not checked, and the check says so."),
             source, columns], NOTES.get(name), anywhere),
        on_card: format_expected(
            [_say(f"What workflows/config/{name}.yaml should reproduce on an {card}, beside",
                  f"{expected.name}: the speeds and job times of that card model."),
             source, columns], None, [_speeds(found, ev), _jobs(results, ev)]),
    }


def evidence() -> Evidence:
    return Evidence(collect(RESULTS), {name: collect(ROOT / _config(name)["results_dir"])
                                       for name in CONFIGS})


def main() -> None:
    ev = evidence()
    for name in CONFIGS:
        for path, text in files(name, ev).items():
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
