# Tables and figures of everything above, the paper's numbers beside them; with
# report.check set, the run fails when a reproduced number drifts past its tolerance. A run
# that writes them also writes results_dir/run.json: what ran, where and how long.
import csv
import datetime
import json
import os
import sys
import time
REPORT = config.get("report", {})
STARTED = time.time()


def train_targets():
    grid = config.get("train", {})
    skip = set(grid.get("exclude", []))
    runs = grid.get("methods", []) + [m + VLLM_RUN for m in grid.get("vllm_methods", [])]
    return [f"{RESULTS}/train/{model}/{recipe}/{run}/metrics.csv"
            for model in grid.get("models", []) for recipe in grid.get("recipes", {})
            for run in runs if f"{model}/{recipe}/{run}" not in skip]


def eval_targets():
    trained = [path.replace("/train/", "/eval/").replace("metrics.csv", "summary.csv")
               for path in train_targets()] if EVAL.get("trained", True) else []
    base = [f"{RESULTS}/eval/{model}/base/{weights}/summary.csv"
            for model in EVAL.get("base_models", [])
            for weights in EVAL.get("base_weights", ["bf16", "nvfp4"])]
    return trained + base


def base_eval_targets():
    return [f"{RESULTS}/eval/{model}/base/external/summary.csv"
            for model in BASE_EVAL.get("models", [])]


def bench_targets():
    return [f"{RESULTS}/bench/{name}" for name in BENCH]


def report_inputs():
    """Everything the tables are made from."""
    return [*train_targets(), *eval_targets(), *base_eval_targets(), *bench_targets(),
            *science_targets()]


def check_arg():
    return f"--check {REPORT['check']}" if REPORT.get("check") else ""


def note_arg():
    return f"--note {shlex.quote(REPORT['note'])}" if REPORT.get("note") else ""


rule report:
    input: report_inputs()
    output: f"{RESULTS}/tables/values.csv"
    params: check=check_arg(), note=note_arg(), results=RESULTS
    log: f"{WORK}/logs/report.log"
    benchmark: f"{WORK}/benchmarks/report.tsv"
    shell: "qerl report --results {params.results} {params.check} {params.note} > {log} 2>&1"


def _reported_this_run() -> bool:
    values = Path(RESULTS, "tables", "values.csv")
    return values.is_file() and values.stat().st_mtime >= STARTED


def _kept() -> list[str]:
    """The report's inputs this run did not make: an earlier run's, or committed ones (a
    fresh clone's results/ holds ours, and Snakemake keeps any output it finds)."""
    return [t for t in report_inputs()
            if Path(t).exists() and Path(t).stat().st_mtime < STARTED]


def say_where_results_are():
    """After a run that wrote the report: where its tables and figures are, the check's
    verdict (a drift fails the report job, so a finished run passed it), and which results
    it kept from before."""
    if not _reported_this_run():
        return  # this run made other targets
    check = REPORT.get("check")
    verdict = (f"every checked value is within its tolerance of {check}" if check
               else "no expected values to check against (report.check)")
    print(f"\nqerl: tables in {RESULTS}/tables/ (values.csv: every number), figures in "
          f"{Path(RESULTS, 'figures')}/, the run's record in {RESULTS}/run.json; {verdict}; "
          f"report log: {WORK}/logs/report.log")
    kept = _kept()
    if kept:
        print(f"qerl: {len(kept)} of the tables' inputs are from before this run (an earlier "
              f"run's or committed, listed in run.json as kept; e.g. {kept[0]}): "
              f"--forceall measures them all on this machine")


def _card() -> str:
    if DEVICE != "cuda":
        return "cpu"
    names = gpu_names()
    return (", ".join(f"{names.count(name)} x {name}" for name in sorted(set(names)))
            or "unknown (nvidia-smi sees no GPU)")


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(
        timespec="seconds")


def write_run_record():
    """results_dir/run.json after a run that wrote the report: the card, the commit, the
    command, start and end, each job's wall time in seconds (its benchmark file, for the
    jobs that ran in this run), and the results it kept from before."""
    if not _reported_this_run():
        return
    root = Path(WORK, "benchmarks")
    jobs = {}
    for tsv in sorted(root.rglob("*.tsv")):
        if tsv.stat().st_mtime >= STARTED:
            with tsv.open() as f:
                rows = list(csv.DictReader(f, delimiter="\t"))
            jobs[str(tsv.relative_to(root).with_suffix(""))] = round(float(rows[-1]["s"]), 1)
    ended = time.time()
    # argv[0] is wherever snakemake was started from (a console script, or python -m's
    # __main__.py): the command a user would type again names the program
    command = shlex.join(["snakemake", *sys.argv[1:]])
    record = {"card": _card(), "commit": COMMIT, "command": command,
              "started": _when(STARTED), "ended": _when(ended),
              "wall_s": round(ended - STARTED, 1), "jobs_s": jobs, "kept": _kept()}
    Path(RESULTS, "run.json").write_text(json.dumps(record, indent=1) + "\n")
