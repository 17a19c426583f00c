"""Expected values: the numbers a configuration's run must reproduce, each with its tolerance
(`qerl report --check FILE`; workflows/expected/ holds ours).

A CSV file with the columns ``key,value,tolerance`` and optionally ``bound``:

- ``key`` names one number of RESULTS/tables/values.csv (collect.key), or a job's wall time
  in seconds, ``job/NAME``, from the run's record (RESULTS/run.json). Two forms name more:
  ``{card}`` in place of a measurement's card is that number on whichever card measured it
  (memory, or what the host CPU measured: the same on any card), and ``stepA-B`` in place of
  ``stepN`` is the mean of steps A to B (one step's reward is too noisy to check).
- ``bound``: ``band`` (the default) within ``tolerance`` of ``value`` either way; ``floor``
  at least ``value - tolerance`` (speeds); ``ceiling`` at most ``value + tolerance`` (memory,
  times). ``tolerance`` is always a distance in the value's own unit.

Lines starting with ``#`` are comments (why each tolerance is what it is); ``# note: TEXT``
lines are the note the report puts above every markdown table (what the values mean, e.g.
that a tiny model's zeros are expected), so that a report checked by hand carries it too.

What depends on the card model (speeds, job times) goes in a file of its own beside FILE,
``STEM-CARD.csv`` (``card_file``), checked where the results were measured on that card.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from qerl.errors import QerlError

BOUNDS = ("band", "floor", "ceiling")
COLUMNS = ("key", "value", "tolerance", "bound")
NOTE = "# note: "
CARD = "{card}"
STEPS = re.compile(r"(?<=/)step(\d+)-(\d+)(?=/)")
JOB = "job/"
WIDTH = 92  # of a comment line


class ExpectedError(QerlError):
    """An expected-values file that cannot be used as one."""


@dataclass(frozen=True)
class Expected:
    """One expected-values file: its rows (``COLUMNS``, bound filled in) and its note."""

    path: Path
    rows: pd.DataFrame
    note: str | None


def read_expected(path: Path) -> Expected:
    """The file at ``path``, refused with the reason where it is not one of expected values."""
    if not path.is_file():
        raise ExpectedError(f"no expected values at {path}")
    text = path.read_text()
    notes = [line.removeprefix(NOTE).strip() for line in text.splitlines()
             if line.startswith(NOTE)]
    try:
        rows = pd.read_csv(path, comment="#", dtype={"key": str})
    except (ValueError, pd.errors.ParserError) as e:
        raise ExpectedError(f"{path}: not a CSV of expected values: {e}") from e
    missing = {"key", "value", "tolerance"} - set(rows.columns)
    if missing:
        raise ExpectedError(f"{path}: needs columns key, value, tolerance (missing "
                            f"{sorted(missing)})")
    unknown = set(rows.columns) - set(COLUMNS)
    if unknown:
        raise ExpectedError(f"{path}: unknown columns {sorted(unknown)} (known: {COLUMNS})")
    rows = rows.assign(bound=rows.get("bound", pd.Series("band", index=rows.index))
                       .fillna("band"))
    for column in ("value", "tolerance"):
        numbers = pd.to_numeric(rows[column], errors="coerce")
        bad = rows.key[numbers.isna()].tolist()
        if bad:
            raise ExpectedError(f"{path}: {column} is not a number for {bad[:3]}")
        rows[column] = numbers
    problems = {"an unknown bound (one of " + ", ".join(BOUNDS) + ")":
                ~rows.bound.isin(BOUNDS),
                "a negative tolerance": rows.tolerance < 0,
                "a key given twice": rows.key.duplicated(keep=False)}
    for what, wrong in problems.items():
        if wrong.any():
            raise ExpectedError(f"{path}: {what}: {rows.key[wrong].tolist()[:3]}")
    return Expected(path, rows[list(COLUMNS)], " ".join(notes) or None)


def card_slug(card: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3', 'cpu' -> 'cpu'."""
    name = card.lower().removeprefix("nvidia ")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def card_file(path: Path, card: str) -> Path:
    """Where the values of ``path``'s configuration that depend on ``card`` are expected."""
    return path.with_name(f"{path.stem}-{card_slug(card)}{path.suffix}")


def format_expected(header: list[str], note: str | None,
                    sections: list[tuple[str, pd.DataFrame]]) -> str:
    """An expected-values file: the ``header`` paragraphs and the note as comments, then the
    column names, and each section's rows (``COLUMNS``) below its paragraph (why its
    tolerance is what it is)."""

    def comment(paragraph: str, prefix: str = "# ") -> list[str]:
        return [prefix + line for line in textwrap.wrap(
            paragraph, WIDTH - len(prefix), break_long_words=False, break_on_hyphens=False)]

    lines = [line for paragraph in header for line in comment(paragraph)]
    lines += comment(note, NOTE) if note else []
    lines.append(",".join(COLUMNS))
    for paragraph, rows in sections:
        lines += comment(paragraph)
        body = rows[list(COLUMNS)].to_csv(index=False, header=False, float_format="%.10g",
                                          lineterminator="\n")
        lines.append(body.rstrip("\n"))
    return "\n".join(lines) + "\n"
