"""Write RESULTS/tables/*.md|csv, RESULTS/figures/*.png and RESULTS/tables/values.csv from
everything under RESULTS, the paper's numbers (package data) beside ours."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import pandas as pd

from qerl.bench.registry import BENCHMARKS
from qerl.errors import QerlError
from qerl.report.check import DriftError, JobTimes, check, paper_verdict
from qerl.report.collect import Results, collect, every, read
from qerl.report.expected import read_expected
from qerl.report.figures import FIGURES
from qerl.report.tables import PAPER_COMPARED, TABLES, paper_comparisons

PAPER = files("qerl.report") / "paper.csv"
OUTPUTS = ("tables", "figures")  # what the report writes under the results folder
PAPER_COLUMNS = ("model", "metric", "method", "lora_rank", "value", "band", "trained_on")


def read_paper(path=PAPER) -> pd.DataFrame:
    """The paper's numbers (``PAPER_COLUMNS``; lines starting with # are comments)."""
    with path.open() as f:
        paper = pd.read_csv(f, comment="#")
    missing = sorted(set(PAPER_COLUMNS) - set(paper.columns))
    unknown = sorted(set(paper.metric) - set(PAPER_COMPARED)) if "metric" in paper else []
    if missing or unknown:
        raise QerlError(f"{path}: the paper's numbers need the columns {PAPER_COLUMNS} "
                        f"(missing {missing}) and metrics among {sorted(PAPER_COMPARED)} "
                        f"(unknown {unknown})")
    return paper


def verdicts(found: Results, results: Path, expected: Path | None = None,
             against_paper: bool = False, paper: pd.DataFrame | None = None,
             jobs: JobTimes | None = None) -> dict:
    """The checks' verdicts on the values ``found`` under ``results``: "check" against the
    values ``expected`` (with the job times of the run's record, or ``jobs``), "paper"
    against the paper's numbers (``against_paper``). What `qerl report` says, and what the
    workflow says at the end of a run once it has recorded its job times."""
    said = {}
    if expected is not None:
        said["check"] = check(found.values, expected, jobs or JobTimes.read(results)).record()
    if against_paper:
        paper = read_paper() if paper is None else paper
        said["paper"] = paper_verdict(paper_comparisons(found.frames, paper)).record()
    return said


def report(results: Path, paper: Path | None = None, expected: Path | None = None,
           against_paper: bool = False) -> dict:
    """Tables and figures of everything under ``results``; with ``expected``, raise
    DriftError if a value drifted past its tolerance or a file under ``results`` is read by
    no table, and put the expected file's note above every markdown table (what its values
    mean); with ``against_paper``, say how many of the paper's numbers were reproduced.
    Returns what was written, those unread files and the verdicts."""
    if not results.is_dir():
        raise QerlError(f"no results folder at {results}")
    if paper is not None and not paper.is_file():
        raise QerlError(f"no paper numbers at {paper}")
    note = read_expected(expected).note if expected is not None else None
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
            heading + markdown(table) + "\n")
        written["tables"].append(name)
    for draw in FIGURES:
        written["figures"] += [p.name for p in draw(found.frames, reference, figures_dir)]
    written["removed"] = _remove_stale(tables_dir, figures_dir, written)
    written["unread"] = [str(path) for path in unread(results, found.files)]
    written.update(verdicts(found, results, expected, against_paper, reference))
    if expected is not None:
        if not written["check"]["passed"]:
            raise DriftError(written["check"]["message"])
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
TABLE_OF = {"eval": "accuracy", "train": "training", "held-out": "science",
            **{b.name: b.table for b in BENCHMARKS if b.table != b.name}}


def summary(kind: str, path: Path) -> str:
    """Markdown: the table of one results file of ``kind`` (what a benchmark prints when
    it has written its rows)."""
    frame, rows_read, _ = read(kind, [path])
    if frame.empty:
        return ""
    table = TABLES[TABLE_OF.get(kind, kind)]({kind: frame, every(kind): rows_read},
                                             read_paper())
    return markdown(table)


def markdown(table: pd.DataFrame) -> str:
    """``table`` as a Markdown table, a | in a header or cell escaped (\\|): unescaped, it
    would end the cell, and the row would no longer match its header."""
    def escape(value):
        return value.replace("|", r"\|") if isinstance(value, str) else value

    return table.rename(columns=escape).map(escape).to_markdown(index=False, floatfmt=".4g")
