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


# How many of a kind's measurements its table shows: a row each, a cell each (tables with
# a column per method or per M), or a row per run (per variant of the study).
def _rows(table, frame, kind):
    return len(table)


def _cells(table, frame, kind):
    spread = {"rollout": ("bf16", "nvfp4", "nf4", "hf-bf16"), "decode_step": ("bf16", "nvfp4")}
    columns = spread.get(kind) or [c for c in table if str(c).startswith("M=")]
    return int(table[[c for c in columns if c in table]].notna().sum().sum())


SHOWN = {"rollout": _cells, "kernels": _cells, "kernel_paths": _cells, "decode_step": _cells}
PER_RUN = {"train": ["model", "recipe", "method"], "science": ["model", "recipe"],
           "held-out": None}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_is_committed_and_every_measurement_shows_in_its_table(committed, kind):
    assert kind in committed.frames, f"no committed {kind} results"
    frame = committed.frames[kind]
    table = TABLES[TABLE_OF.get(kind, kind)](committed.frames, read_paper())
    assert not table.empty
    if kind in PER_RUN:
        if PER_RUN[kind] is not None:
            assert len(table) == len(frame.drop_duplicates(PER_RUN[kind]))
        else:  # each held-out benchmark's mean over seeds: a column per benchmark
            for bench in frame.bench.unique():
                assert any(c.startswith(f"{bench} avg@") for c in table), bench
        return
    measured = frame if kind not in SHOWN else frame[frame.get(
        "tok_per_s", frame.get("step_ms", frame.get("speedup_vs_bf16"))).notna()]
    assert SHOWN.get(kind, _rows)(table, frame, kind) == len(measured)


def test_the_committed_values_are_what_qerl_report_makes_of_the_results(committed):
    """Rerun `qerl report --results results` after adding or changing a result."""
    saved = pd.read_csv(RESULTS / "tables/values.csv").set_index("key").value
    fresh = committed.values.set_index("key").value
    assert sorted(saved.index) == sorted(fresh.index)
    assert saved[fresh.index].to_numpy() == pytest.approx(fresh.to_numpy(), rel=1e-12)
