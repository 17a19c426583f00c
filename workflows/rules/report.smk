# Tables and figures of everything above, the paper's numbers beside them; with
# report.check set, the run fails when a reproduced number drifts past its tolerance, and
# with report.check_paper it says how many of the paper's numbers it reproduced. A run that
# writes them also writes results_dir/run.json: what ran, where, how long, and the verdicts.
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


def check_args():
    """qerl report's checks, as the configuration asks: against our expected values
    (report.check), against the paper's numbers (report.check_paper)."""
    checks = ["--check", REPORT["check"]] if REPORT.get("check") else []
    return shlex.join(checks + (["--check-paper"] if REPORT.get("check_paper") else []))


RUN_RECORD = Path(RESULTS, "run.json")
REPORT_LOG = Path(WORK, "logs", "report.log")


# The record of the run that made the results before goes first (they are being remade);
# this run's job times, known once its jobs are done, are checked when it writes its own.
rule report:
    input: report_inputs()
    output: f"{RESULTS}/tables/values.csv"
    params: checks=check_args(), results=RESULTS, record=str(RUN_RECORD)
    log: str(REPORT_LOG)
    benchmark: f"{WORK}/benchmarks/report.tsv"
    shell: "rm -f {params.record}; qerl report --results {params.results} {params.checks} "
           "> {log} 2>&1"


def _reported_this_run() -> bool:
    values = Path(RESULTS, "tables", "values.csv")
    return values.is_file() and values.stat().st_mtime >= STARTED


def _kept() -> list[str]:
    """The report's inputs this run did not make: an earlier run's, or committed ones (a
    fresh clone's results/ holds ours, and Snakemake keeps any output it finds)."""
    return [t for t in report_inputs()
            if Path(t).exists() and Path(t).stat().st_mtime < STARTED]


def say_where_results_are():
    """After a run that wrote the report: where its tables and figures are, the checks'
    verdicts (a drift of a reported number fails the report job; one of a job time fails the
    run here), and which results it kept from before."""
    if not _reported_this_run():
        return  # this run made other targets
    record = json.loads(RUN_RECORD.read_text())
    check = record.get("check")
    verdict = (check["message"] if check
               else "no expected values to check against (report.check)")
    print(f"\nqerl: tables in {RESULTS}/tables/ (values.csv: every number), figures in "
          f"{Path(RESULTS, 'figures')}/, the run's record in {RUN_RECORD}; {verdict}; "
          f"report log: {REPORT_LOG}")
    if "paper" in record:
        print(f"qerl: the paper's numbers: {record['paper']['message']}")
    kept = _kept()
    if kept:
        print(f"qerl: {len(kept)} of the tables' inputs are from before this run (an earlier "
              f"run's or committed, listed in run.json as kept; e.g. {kept[0]}): "
              f"--forceall measures them all on this machine")
    if check and not check["passed"]:
        raise WorkflowError(f"the check failed (run.json records it): {check['message']}")


def _report_error() -> str | None:
    """The error the report job of this run ended with (a drift, a result no table reads),
    from its log; None where it did not run or did not fail."""
    if not REPORT_LOG.is_file() or REPORT_LOG.stat().st_mtime < STARTED:
        return None
    _, failed, error = REPORT_LOG.read_text().partition("qerl report: error: ")
    return error.strip() if failed else None


def record_failed_report():
    """After a run whose report job failed: the run's record with its verdict (report.check's,
    failed), and the verdict said last."""
    error = _report_error()
    if error is None:
        return
    record = _run_record()
    record["check"] = {"passed": False, "message": error}
    RUN_RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nqerl: the report failed (run.json records it): {error}\n"
          f"qerl: report log: {REPORT_LOG}")


def _card() -> str:
    """The cards the run held, named as its rows' card column names them (a CPU's model on
    a CPU, qerl.record.card_name)."""
    if DEVICE != "cuda":
        from qerl.record import card_name

        return card_name("cpu")
    names = gpu_names()
    return (", ".join(f"{names.count(name)} x {name}" for name in sorted(set(names)))
            or "unknown (nvidia-smi sees no GPU)")


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(
        timespec="seconds")


def _run_record() -> dict:
    """The card, the commit, the command, start and end, each job's wall time in seconds
    (its benchmark file, for the jobs that ran in this run), and the results kept from
    before."""
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
    return {"card": _card(), "commit": COMMIT, "command": command,
            "started": _when(STARTED), "ended": _when(ended),
            "wall_s": round(ended - STARTED, 1), "jobs_s": jobs, "kept": _kept()}


def _verdicts(record: dict) -> dict:
    """What `qerl report --check FILE` (report.check) and `--check-paper` (report.check_paper)
    say of the results by hand, with this run's job times (``record``'s)."""
    if not (REPORT.get("check") or REPORT.get("check_paper")):
        return {}
    from qerl.report.check import JobTimes
    from qerl.report.collect import collect
    from qerl.report.run import verdicts

    jobs = JobTimes(record["jobs_s"], JobTimes.card_of(record["card"]))
    expected = Path(REPORT["check"]) if REPORT.get("check") else None
    return verdicts(collect(Path(RESULTS)), Path(RESULTS), expected,
                    bool(REPORT.get("check_paper")), jobs=jobs)


def write_run_record():
    """results_dir/run.json after a run that wrote the report (``_run_record``), with the
    checks' verdicts."""
    if not _reported_this_run():
        return
    record = _run_record()
    record.update(_verdicts(record))
    RUN_RECORD.write_text(json.dumps(record, indent=1) + "\n")
