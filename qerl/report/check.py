"""`qerl report --check EXPECTED.csv`: every expected value (columns key, value, tolerance:
absolute) must be among the reproduced values and within its tolerance."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from qerl.errors import QerlError


class DriftError(QerlError):
    """Reproduced numbers moved past their tolerance (or went missing)."""


def read_expected(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise DriftError(f"no expected values at {path}")
    expected = pd.read_csv(path, comment="#")
    missing = {"key", "value", "tolerance"} - set(expected.columns)
    if missing:
        raise DriftError(f"{path}: needs columns key, value, tolerance (missing {sorted(missing)})")
    return expected


def drifts(values: pd.DataFrame, expected: pd.DataFrame) -> list[str]:
    """One line per expected value that is missing or outside its tolerance."""
    got = dict(zip(values.key, values.value, strict=True))
    problems = []
    for row in expected.itertuples():
        if row.key not in got:
            problems.append(f"{row.key}: missing (expected {row.value})")
        elif not abs(float(got[row.key]) - float(row.value)) <= float(row.tolerance):
            problems.append(f"{row.key}: {got[row.key]} (expected {row.value} +- "
                            f"{row.tolerance})")
    return problems


def check(values: pd.DataFrame, expected_file: Path) -> None:
    problems = drifts(values, read_expected(expected_file))
    if problems:
        raise DriftError(f"{len(problems)} value(s) drifted from {expected_file}:\n  "
                         + "\n  ".join(problems))
