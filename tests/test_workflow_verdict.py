"""How a run of the workflow ends: its report checks the numbers against the configuration's
expected values, says the verdict last and writes it into run.json; a drifted number fails
the run, naming its key. A run of the report alone, on a results folder made beforehand."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pandas as pd

from tests.test_workflow import config, snakemake

KEY = "train/tiny/arithmetic/qerl/step1-2/reward"


def report_only(tmp: Path, expected_reward: float) -> tuple:
    """The smoke configuration with nothing to train or evaluate, its results folder
    holding one training run (reward 0.25 at both steps), checked against ``KEY`` at
    ``expected_reward`` +- 0.01; the run's output and its record."""
    results = tmp / "results"
    run = results / "train/tiny/arithmetic/qerl"
    run.mkdir(parents=True)
    pd.DataFrame({"step": [1, 2], "reward": [0.25, 0.25]}).to_csv(run / "metrics.csv",
                                                                   index=False)
    expected = tmp / "expected.csv"
    expected.write_text(f"# note: A note for the tables.\nkey,value,tolerance\n"
                        f"{KEY},{expected_reward},0.01\n")
    smoke = config("smoke")
    smoke.update(work_dir=str(tmp / "work"), results_dir=str(results),
                 report={"check": str(expected)})
    smoke.pop("train"), smoke.pop("eval")
    # The report job runs the qerl installed beside this interpreter.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    done = snakemake("--cores", "1", config=smoke, tmp=tmp, env={"PATH": path})
    record = results / "run.json"
    return done, json.loads(record.read_text()) if record.is_file() else None, expected


def test_a_run_ends_with_the_checks_verdict_and_records_it(tmp_path):
    done, record, expected = report_only(tmp_path, 0.25)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    verdict = f"every checked value is within its tolerance of {expected} (1 values)"
    ending = next(line for line in done.stdout.splitlines() if line.startswith("qerl: tables"))
    assert f"; {verdict}; report log:" in ending
    assert record["check"]["passed"] and record["check"]["message"].startswith(verdict)
    assert set(record["jobs_s"]) == {"report"}
    assert (tmp_path / "results/tables/training.md").read_text().startswith(
        "> A note for the tables.")


def test_a_drifted_number_fails_the_run_and_names_its_key(tmp_path):
    done, record, _ = report_only(tmp_path, 0.5)
    said = done.stdout + done.stderr
    assert done.returncode != 0
    drift = f"{KEY}: 0.25 (expected 0.5 +- 0.01)"
    assert "qerl: the report failed (run.json records it): 1 value(s) drifted" in said
    assert drift in said
    assert record["check"]["passed"] is False and drift in record["check"]["message"]
