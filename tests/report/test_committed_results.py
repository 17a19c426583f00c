"""The committed results: every file under results/ is read by `qerl report`, every kind of
result is there and shows in its table, measurement by measurement, and the committed
results/tables/values.csv is what `qerl report` makes of them today."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from qerl.report.collect import KINDS, collect
from qerl.report.run import TABLE_OF, read_paper, unread
from qerl.report.tables import TABLES
from tests.conftest import require

RESULTS = Path(__file__).resolve().parents[2] / "results"


@pytest.fixture(scope="module")
def committed():
    return collect(RESULTS)


def test_every_committed_file_is_read(committed):
    left = [str(p.relative_to(RESULTS)) for p in unread(RESULTS, committed.files)]
    assert not left, f"results that qerl report does not read: {left}"


# Kinds whose table spreads one number over columns (a column per weights, or per M): each
# measurement of it is one cell.
SPREAD = {"rollout": ("tok_per_s", ("bf16", "nvfp4", "nf4", "hf-bf16", "vllm-bf16", "vllm-nvfp4")),
          "decode_step": ("step_ms", ("bf16", "nvfp4")),
          "kernels": ("speedup_vs_bf16", "M="), "kernel_paths": ("speedup_vs_bf16", "M="),
          "token_tiles": ("speedup_vs_bf16", "M=")}
# Kinds whose table has a row per run (per variant of the study).
PER_RUN = {"train": ["model", "recipe", "method"], "science": ["model", "recipe"]}


# Kinds registered before their first rows, which need hardware no run has had yet, each
# with what will measure it; once its rows are committed, its entry goes.
AWAITED: dict[str, str] = {}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_is_committed_and_every_measurement_shows_in_its_table(committed, kind):
    if kind in AWAITED:
        assert kind not in committed.frames, f"{kind} rows are committed: take it off AWAITED"
        pytest.skip(f"awaited: {AWAITED[kind]}")
    assert kind in committed.frames, f"no committed {kind} results"
    frame = committed.frames[kind]
    table = TABLES[TABLE_OF.get(kind, kind)](committed.frames, read_paper())
    assert not table.empty
    if kind in PER_RUN:
        assert len(table) == len(frame.drop_duplicates(PER_RUN[kind]))
    elif kind == "held-out":  # each benchmark's mean over seeds: a column per benchmark
        for bench in frame.bench.unique():
            assert any(c.startswith(f"{bench} avg@") for c in table), bench
    elif kind in SPREAD:
        value, columns = SPREAD[kind]
        cells = [c for c in table if (c in columns if isinstance(columns, tuple)
                                      else str(c).startswith(columns))]
        assert int(table[cells].notna().sum().sum()) == int(frame[value].notna().sum())
    else:
        assert len(table) == len(frame)


def assert_values_current(results: Path, found) -> None:
    """results/tables/values.csv holds what `qerl report` makes of ``found`` today."""
    saved = pd.read_csv(results / "tables/values.csv").set_index("key").value
    fresh = found.values.set_index("key").value
    assert sorted(saved.index) == sorted(fresh.index)
    assert saved[fresh.index].to_numpy() == pytest.approx(fresh.to_numpy(), rel=1e-12)


def test_the_committed_values_are_what_qerl_report_makes_of_the_results(committed):
    """Rerun `qerl report --results results` after adding or changing a result."""
    assert_values_current(RESULTS, committed)


@pytest.mark.parametrize("folder", sorted(p.parent.parent.name
                                          for p in RESULTS.glob("*/tables/values.csv")))
def test_nested_results_folders_are_read_whole_and_their_values_are_current(folder):
    """A results folder of its own (a workflow configuration's, e.g. rehearsal/): every
    file read by its own report, and its values.csv what `qerl report --results
    results/FOLDER` makes of it today."""
    results = RESULTS / folder
    found = collect(results)
    assert not [str(p.relative_to(results)) for p in unread(results, found.files)]
    assert_values_current(results, found)


def markdown_tables(text: str) -> list[list[int]]:
    """Each table of a Markdown text as a GitHub-flavoured renderer reads it (markdown-it,
    not our writer): the cell count of each row, header first."""
    markdown_it = require("markdown_it")
    tables, rows = [], None
    for token in markdown_it.MarkdownIt("commonmark").enable("table").parse(text):
        if token.type == "table_open":
            rows = []
        elif token.type == "tr_open":
            rows.append(0)
        elif token.type in ("th_open", "td_open"):
            rows[-1] += 1
        elif token.type == "table_close":
            tables.append(rows)
    return tables


@pytest.mark.parametrize("path", sorted(RESULTS.glob("**/tables/*.md")),
                         ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_committed_table_is_a_markdown_table(path):
    """One table, every row as many cells as its header and as the table's CSV has
    columns (a | in a header once made 15 header cells over 13 delimiters: plain text)."""
    tables = markdown_tables(path.read_text())
    assert len(tables) == 1, f"{path}: {len(tables)} tables"
    columns = len(pd.read_csv(path.with_suffix(".csv"), nrows=0).columns)
    assert set(tables[0]) == {columns} and len(tables[0]) > 1, path


def test_a_bar_in_a_header_or_cell_stays_in_its_cell():
    from qerl.report.run import markdown

    table = pd.DataFrame({"mean |d log p|": [0.5, 1.0], "what": ["a | b", "c"]})
    assert markdown_tables(markdown(table)) == [[2, 2, 2]]
