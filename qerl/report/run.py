"""Write RESULTS/tables/*.md|csv, RESULTS/figures/*.png and RESULTS/tables/values.csv from
everything under RESULTS, the paper's numbers (package data) beside ours."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import pandas as pd

from qerl.errors import QerlError
from qerl.report.check import DriftError, check
from qerl.report.collect import collect, every, read
from qerl.report.figures import FIGURES
from qerl.report.tables import TABLES

PAPER = files("qerl.report") / "paper.csv"
OUTPUTS = ("tables", "figures")  # what the report writes under the results folder


def read_paper(path=PAPER) -> pd.DataFrame:
    with path.open() as f:
        return pd.read_csv(f)


def report(results: Path, paper: Path | None = None, expected: Path | None = None,
           note: str | None = None) -> dict:
    """Tables and figures of everything under ``results``; with ``expected``, raise
    DriftError if a value drifted past its tolerance or a file under ``results`` is read by
    no table; ``note`` goes above every markdown table (what its values mean). Returns
    what was written, and those unread files."""
    if not results.is_dir():
        raise QerlError(f"no results folder at {results}")
    if paper is not None and not paper.is_file():
        raise QerlError(f"no paper numbers at {paper}")
    found = collect(results)
    reference = read_paper(paper or PAPER)
    tables_dir, figures_dir = results / "tables", results / "figures"
    tables_dir.mkdir(parents=True, exist_ok=True)
    figures_dir.mkdir(parents=True, exist_ok=True)
    found.values.to_csv(tables_dir / "values.csv", index=False)
    written = {"values": tables_dir / "values.csv", "tables": [], "figures": []}
    for name, build in TABLES.items():
        table = build(found.frames, reference)
        if table.empty:
            continue
        table.to_csv(tables_dir / f"{name}.csv", index=False)
        heading = f"> {note}\n\n" if note else ""
        (tables_dir / f"{name}.md").write_text(
            heading + table.to_markdown(index=False, floatfmt=".4g") + "\n")
        written["tables"].append(name)
    for draw in FIGURES:
        written["figures"] += [p.name for p in draw(found.frames, reference, figures_dir)]
    written["removed"] = _remove_stale(tables_dir, figures_dir, written)
    written["unread"] = [str(path) for path in unread(results, found.files)]
    if expected is not None:
        check(found.values, expected)
        if written["unread"]:  # a result that no table shows is a result lost
            raise DriftError(f"files under {results} that no table reads: {written['unread']}")
    return written


# The figures the last report drew, so that the next removes only its own stale ones.
DRAWN = ".drawn"


def _remove_stale(tables_dir: Path, figures_dir: Path, written: dict) -> list[str]:
    """Remove what an earlier report wrote and this one did not (a table now empty, a
    figure whose panels no longer hold one run), so that no output outlives the
    measurements it showed. Only the report's own files go: the tables it names, the
    figures the last report drew (listed in figures/DRAWN)."""
    ours = {f"{name}.{ext}" for name in TABLES for ext in ("csv", "md")}
    fresh = {f"{name}.{ext}" for name in written["tables"] for ext in ("csv", "md")}
    stale = [p for p in tables_dir.iterdir() if p.name in ours - fresh]
    drawn = figures_dir / DRAWN
    before = drawn.read_text().split() if drawn.is_file() else []
    stale += [figures_dir / name for name in before if name not in written["figures"]
              and (figures_dir / name).is_file()]
    for path in stale:
        path.unlink()
    drawn.write_text("".join(f"{name}\n" for name in sorted(written["figures"])))
    return sorted(str(path) for path in stale)


def unread(results: Path, read: set[Path]) -> list[Path]:
    """Files under ``results`` that no kind of result reads (READMEs, hidden files such as
    the writers' locks, what the report writes aside, the workflow's run records
    ``run*.json`` beside them, and nested results folders, which have tables of their
    own): a result in the wrong place, or a kind the report does not know."""
    nested = [folder.parent.parent for folder in results.glob("*/tables/values.csv")]
    return sorted(path for path in results.rglob("*")
                  if path.is_file() and path not in read and path.name != "README.md"
                  and not path.name.startswith(".")
                  and path.relative_to(results).parts[0] not in OUTPUTS
                  and not (path.parent == results and path.match("run*.json"))
                  and not any(path.is_relative_to(folder) for folder in nested))


# The table that shows each kind of result, where it is not named after the kind.
TABLE_OF = {"step": "efficiency", "eval": "accuracy", "train": "training",
            "held-out": "science"}


def summary(kind: str, path: Path) -> str:
    """Markdown: the table of one results file of ``kind`` (what a benchmark prints when
    it has written its rows)."""
    frame, rows_read, _ = read(kind, [path])
    if frame.empty:
        return ""
    table = TABLES[TABLE_OF.get(kind, kind)]({kind: frame, every(kind): rows_read},
                                             read_paper())
    return table.to_markdown(index=False, floatfmt=".4g")
