"""Write results/tables/*.md|csv, results/figures/*.png and results/tables/values.csv."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from qerl.report.check import check
from qerl.report.collect import collect
from qerl.report.figures import FIGURES
from qerl.report.tables import TABLES

PAPER = Path(__file__).parents[2] / "results" / "reference" / "paper.csv"


def report(results: Path, paper: Path = PAPER, expected: Path | None = None) -> dict:
    """Tables and figures of everything under ``results``; with ``expected``, raise
    DriftError if a value drifted past its tolerance. Returns what was written."""
    values = collect(results)
    tables_dir, figures_dir = results / "tables", results / "figures"
    tables_dir.mkdir(parents=True, exist_ok=True)
    figures_dir.mkdir(parents=True, exist_ok=True)
    values.to_csv(tables_dir / "values.csv", index=False)
    written = {"values": tables_dir / "values.csv", "tables": [], "figures": []}
    reference = pd.read_csv(paper)
    for name, build in TABLES.items():
        table = build(values, reference)
        if table.empty:
            continue
        table.to_csv(tables_dir / f"{name}.csv", index=False)
        (tables_dir / f"{name}.md").write_text(table.to_markdown(index=False, floatfmt=".4g")
                                               + "\n")
        written["tables"].append(name)
    for draw in FIGURES:
        written["figures"] += [p.name for p in draw(values, figures_dir)]
    if expected is not None:
        check(values, expected)
    return written
