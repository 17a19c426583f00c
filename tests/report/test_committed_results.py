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


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_is_committed_and_every_measurement_shows_in_its_table(committed, kind):
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
