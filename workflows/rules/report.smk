# Tables and figures of everything above, the paper's numbers beside them; with
# report.check set, the run fails when a reproduced number drifts past its tolerance.
import time
REPORT = config.get("report", {})
STARTED = time.time()


def train_targets():
    grid = config.get("train", {})
    skip = set(grid.get("exclude", []))
    return [f"{RESULTS}/train/{model}/{recipe}/{method}/metrics.csv"
            for model in grid.get("models", []) for recipe in grid.get("recipes", {})
            for method in grid.get("methods", []) if f"{model}/{recipe}/{method}" not in skip]


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


def check_arg():
    return f"--check {REPORT['check']}" if REPORT.get("check") else ""


def note_arg():
    return f"--note {shlex.quote(REPORT['note'])}" if REPORT.get("note") else ""


rule report:
    input: train_targets(), eval_targets(), base_eval_targets(), bench_targets(), science_targets()
    output: f"{RESULTS}/tables/values.csv"
    params: check=check_arg(), note=note_arg(), results=RESULTS
    log: f"{WORK}/logs/report.log"
    shell: "qerl report --results {params.results} {params.check} {params.note} > {log} 2>&1"


def say_where_results_are():
    """After a run that wrote the report: where its tables and figures are, and the check's
    verdict (a drift fails the report job, so a finished run passed it)."""
    values = Path(RESULTS, "tables", "values.csv")
    if not values.is_file() or values.stat().st_mtime < STARTED:
        return  # this run made other targets
    check = REPORT.get("check")
    verdict = (f"every checked value is within its tolerance of {check}" if check
               else "no expected values to check against (report.check)")
    print(f"\nqerl: tables in {values.parent}/ (values.csv: every number), figures in "
          f"{Path(RESULTS, 'figures')}/; {verdict}; report log: {WORK}/logs/report.log")
