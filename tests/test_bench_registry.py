"""A benchmark registered once (qerl.bench.registry) is found everywhere it must be: `qerl
bench` runs its module, the workflow's rule runs its command as the registration says, and
`qerl report` reads its rows, keys its values by its name and shows them in its table."""

from __future__ import annotations

import argparse
import importlib

import pandas as pd
import pytest

from qerl.bench.registry import BENCHMARKS, COMMANDS, Benchmark
from qerl.cli import build_parser
from qerl.errors import QerlError
from qerl.report.run import report
from tests.test_workflow import ROOT, config, shell_commands, snakemake

RUN = [b for b in BENCHMARKS if b.command is not None]


def test_names_commands_and_tables_are_each_registered_once():
    for names in ([b.name for b in BENCHMARKS], [b.command for b in RUN]):
        assert len(set(names)) == len(names), names


def test_qerl_bench_offers_every_registered_command_and_runs_its_module():
    bench = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
                 ).choices["bench"]
    what = next(a for a in bench._actions if a.dest == "what")
    assert sorted(what.choices) == sorted(b.command for b in RUN)
    for b in RUN:
        assert callable(importlib.import_module(b.module).main), b.module


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The shell commands of a dry run of the GPU and science configurations, every
    benchmark the bench rule runs asked for: the plan of each registered command."""
    settings = {**config("gpu"), **config("science"),
                "bench": {b.command: "" for b in RUN if b.rule == "bench"}}
    done = snakemake("-n", "-p", "--forceall", "bench_all", "science_all",
                     config=settings, tmp=tmp_path_factory.mktemp("plan"))
    assert done.returncode == 0, done.stderr[-3000:]
    return shell_commands(done), settings["results_dir"]


@pytest.mark.parametrize("benchmark", [b for b in RUN if b.rule], ids=lambda b: b.name)
def test_the_workflow_runs_each_registered_command_as_registered(planned, benchmark):
    commands, results = planned
    runs = [c for c in commands if f" qerl bench {benchmark.command} " in c]
    assert len(runs) == 1, (benchmark.command, runs)
    if benchmark.rule != "bench":
        return
    folder = f"{results}/bench/{benchmark.command}"
    out = (f"--out {folder}/{benchmark.command}.csv" if benchmark.out == "file"
           else f"--out-dir {folder}")
    assert out in runs[0]
    # On a GPU configuration every benchmark holds the GPU whole, but one that runs on the CPU.
    assert ("gpu_slot.py" in runs[0] and "--whole" in runs[0]) == (benchmark.device != "cpu")


def one_row(benchmark: Benchmark) -> dict:
    """A row of ``benchmark`` as its writer would lay it out: its naming columns, each
    setting 1 and each number 0.5."""
    model = {"layer": "qwen2.5-7b.down"} if benchmark.model_in_layer else {
        benchmark.model: "qwen2.5-7b"}
    return {"card": "a card", benchmark.method: "nvfp4", **dict.fromkeys(benchmark.setting, 1),
            **model, **dict.fromkeys(benchmark.metrics, 0.5)}


def a_file(pattern: str) -> str:
    """A file ``pattern`` matches: bench/**/x_*.csv -> bench/x_a.csv."""
    return pattern.replace("/**/", "/").replace("*", "a")


def test_the_report_reads_and_tabulates_every_registered_kind(tmp_path):
    results = tmp_path / "results"
    for b in BENCHMARKS:
        path = results / a_file(b.patterns[0])
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame([one_row(b)]).to_csv(path, index=False)
    written = report(results)
    assert written["unread"] == []
    values = pd.read_csv(results / "tables/values.csv")
    for b in BENCHMARKS:
        rows = values[values.kind == b.name]
        card = b.card or "a card"
        assert set(rows.card) == {card} and set(rows.method) == {"nvfp4"}, b.name
        expected_model = "a" if b.model_from_path else "qwen2.5-7b"
        assert set(rows.model) == {expected_model}, b.name
        assert set(rows.metric) >= {m for m in b.metrics if m in one_row(b)} - {
            "speed_vs_lora", "ceiling_vs_bf16"}, b.name  # computed over pairs of rows
        assert rows.key.str.startswith(f"{b.name}/").all()
        assert b.table in written["tables"], b.name
        table = pd.read_csv(results / "tables" / f"{b.table}.csv")
        assert len(table) == 1, b.name


@pytest.mark.parametrize("change, message", [
    ({"command": "x"}, "a command and its module go together"),
    ({"rule": "bench"}, "rule bench runs no command"),
    ({"command": "x", "module": "m", "device": "gpu"}, "device 'gpu' is not one of"),
    ({"command": "x", "module": "m", "out": "folder"}, "out 'folder' is not one of"),
])
def test_a_registration_that_cannot_run_is_refused(change, message):
    with pytest.raises(QerlError, match=f"benchmark x: {message}"):
        Benchmark("x", ("bench/**/x_*.csv",), **change)


def test_a_kind_written_outside_qerl_has_no_command_and_its_table_is_its_name():
    image = Benchmark("image", ("bench/**/image*.csv",))
    assert image.command is None and image.rule is None and image.table == "image"
    assert "image" not in COMMANDS


def test_every_module_of_qerl_bench_is_registered_or_helps_another():
    """A benchmark module nothing registers would be run by nothing."""
    folder = ROOT / "qerl/bench"
    modules = {f"qerl.bench.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__"}
    sources = "\n".join(p.read_text() for p in folder.glob("*.py"))
    helpers = {m for m in modules if f"from {m} import" in sources}
    assert set(COMMANDS.values()) <= modules
    assert modules - helpers - {"qerl.bench.registry"} <= set(COMMANDS.values())
