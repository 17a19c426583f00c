"""qerl eval-import: lm-eval's and lighteval's results files (real ones, tests/data/external)
read into summary rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from qerl.cli import main
from qerl.eval.external import bench_of, read_results, results_file
from qerl.eval.run import EvalError

DATA = Path(__file__).parents[1] / "data" / "external"


def test_lm_eval_gsm8k_gives_both_filters_with_their_stderr():
    rows = read_results(DATA / "lm-eval")
    assert [r["metric"] for r in rows] == ["exact_match,strict-match",
                                           "exact_match,flexible-extract"]
    for row in rows:
        assert row["tool"] == "lm-eval" and row["tool_version"] == "0.4.13"
        assert row["bench"] == "gsm8k" and row["task"] == "gsm8k_local"
        assert row["shots"] == 5 and row["problems"] == 10 and row["limit"] == 10
        assert row["value"] == 0.0 and row["stderr"] == 0.0
        assert row["model"] == "models/tiny" and row["date"] == "2026-11-26 08:38"


def test_lighteval_gives_each_task_but_not_the_cross_task_average():
    rows = read_results(DATA / "lighteval")
    got = {(r["bench"], r["metric"]) for r in rows}
    assert got == {("math500", "pass@k:k=1&n=1"), ("aime24", "pass@k:k=1"),
                   ("aime24", "avg@n:n=1"), ("aime25", "pass@k:k=1&n=1"),
                   ("aime25", "avg@n:n=1")}
    assert all(r["tool"] == "lighteval" and r["limit"] == 5 and r["shots"] == 0
               and r["stderr"] == 0.0 for r in rows)


def test_a_folder_gives_its_newest_results_file(tmp_path):
    for stamp in ("2026-01-02T10-00-00.1", "2026-03-01T09-00-00.1", "2026-02-01T23-00-00.1"):
        folder = tmp_path / stamp
        folder.mkdir()
        shutil.copy(next((DATA / "lm-eval").glob("*.json")), folder / f"results_{stamp}.json")
    assert results_file(tmp_path).name == "results_2026-03-01T09-00-00.1.json"


@pytest.mark.parametrize("task, bench", [("gsm8k", "gsm8k"), ("gsm8k_local", "gsm8k"),
                                         ("lighteval|math_500|0", "math500"),
                                         ("math_500_qerl|0", "math500"), ("aime25|0", "aime25")])
def test_task_names_map_to_our_benchmarks(task, bench):
    assert bench_of(task) == bench


def test_cli_writes_one_summary_for_both_tools(tmp_path):
    out = tmp_path / "base"
    assert main(["eval-import", str(DATA / "lm-eval"), str(DATA / "lighteval"),
                 "--out", str(out)]) == 0
    table = pd.read_csv(out / "summary.csv")
    assert sorted(set(table.bench)) == ["aime24", "aime25", "gsm8k", "math500"]
    assert len(json.loads((out / "summary.json").read_text())) == len(table) == 7


def bad(tmp_path, text: str) -> Path:
    path = tmp_path / "results_2026-01-01T00-00-00.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "nothing", "no such file"),
    (lambda p: p, "no results_"),
    (lambda p: bad(p, "{not json"), "not a readable results JSON"),
    (lambda p: bad(p, '{"scores": 1}'), "no 'results'"),
    (lambda p: bad(p, '{"results": {}}'), "neither lm-eval"),
    (lambda p: bad(p, '{"results": {"hellaswag": {"acc,none": 0.3}}, "n-samples": {}}'),
     "'hellaswag' is none of the benchmarks"),
    (lambda p: bad(p, '{"results": {}, "n-samples": {}}'), "no metric values"),
])
def test_bad_results_are_refused_naming_the_cause(tmp_path, make, message):
    with pytest.raises(EvalError, match=message):
        read_results(make(tmp_path))
