"""Verdicts: our numbers against the values a configuration expects (`qerl report --check
FILE`, qerl.report.expected), and against the paper's (`qerl report --check-paper`).

The first fails a run (DriftError) when a number is missing or past its tolerance; what it
could not check (a card model with no expected file, job times without a run record) it
names. The second says how many of the paper's numbers were reproduced, within the bands
qerl/report/paper.csv states, and why each other one was not: a finding, not a failure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from qerl.errors import QerlError
from qerl.report.expected import CARD, JOB, STEPS, ExpectedError, card_file, read_expected

# The workflow's record of a run, beside its results (workflows/rules/report.smk).
RUN_RECORD = "run.json"


class DriftError(QerlError):
    """Reproduced numbers moved past their tolerance (or went missing)."""


@dataclass(frozen=True)
class JobTimes:
    """A run's job wall times (s, by job name) and the card model they ran on (None where
    the run held several)."""

    seconds: dict[str, float]
    card: str | None

    @staticmethod
    def card_of(described: str) -> str | None:
        """The card model of a run record's "card": "cpu", or "N x NAME" per model, comma
        separated (report.smk's _card)."""
        names = {re.sub(r"^\d+ x ", "", part) for part in described.split(", ")}
        return names.pop() if len(names) == 1 else None

    @classmethod
    def read(cls, results: Path) -> JobTimes | None:
        """The job times of the run that wrote ``results`` (None without its record)."""
        path = results / RUN_RECORD
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
            return cls({name: float(s) for name, s in record["jobs_s"].items()},
                       cls.card_of(record["card"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise QerlError(f"{path}: not a run record (card, jobs_s): {e}") from e


@dataclass
class Verdict:
    """What the check found: the files it read, how many comparisons it made, one line
    per drift, and one per kind of number it could not check."""

    files: list[Path]
    checked: int = 0
    drifted: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.drifted

    def message(self) -> str:
        files = " and ".join(str(f) for f in self.files)
        if self.passed:
            said = (f"every checked value is within its tolerance of {files} "
                    f"({self.checked} values)")
        else:
            said = (f"{len(self.drifted)} value(s) drifted from {files}:\n  "
                    + "\n  ".join(self.drifted))
        if self.unchecked:
            said += ("; " if self.passed else "\n") + "not checked: " + "; ".join(self.unchecked)
        return said

    def record(self) -> dict:
        return {"passed": self.passed, "files": [str(f) for f in self.files],
                "checked": self.checked, "drifted": self.drifted,
                "not_checked": self.unchecked, "message": self.message()}


def _observed(values: pd.DataFrame, jobs: JobTimes | None) -> pd.DataFrame:
    """key, value, card, kind, metric and per_card (the key names the card: a measurement,
    or a job time) of every number there is to check."""
    frame = values[["key", "value", "card", "kind", "metric"]].assign(
        per_card=(values.recipe == values.card) & values.card.notna())
    if jobs is not None and jobs.card is not None:
        times = pd.DataFrame({"key": [JOB + name for name in jobs.seconds],
                              "value": list(jobs.seconds.values()), "card": jobs.card,
                              "kind": JOB.rstrip("/"), "metric": "", "per_card": True})
        frame = pd.concat([frame, times], ignore_index=True)
    return frame


def _checked_on_cards(expected: Path, seen: pd.DataFrame) -> tuple[pd.Series, list[Path]]:
    """Which of ``seen`` are of a kind and metric that the card files of ``expected`` check
    (on their cards), and those files: what a card without a file of its own leaves
    unchecked."""
    files = sorted(expected.parent.glob(f"{expected.stem}-*{expected.suffix}"))
    keys = pd.concat([read_expected(f).rows.key for f in files] or [pd.Series(dtype=str)])
    checked = pd.Series(False, index=seen.index)
    for (kind, metric), rows in seen.groupby(["kind", "metric"]):
        checked[rows.index] = (keys.str.startswith(f"{kind}/")
                               & keys.str.endswith(f"/{metric}" if metric else "")).any()
    return checked, files


def _resolve(key: str, got: dict, cards: list[str]) -> list[tuple[str, float | None]]:
    """The numbers ``key`` names, each with a name for the message (None: missing).
    ``{card}``: the key on each card that has it; ``stepA-B``: the mean of those steps,
    missing if any one is."""
    names = [key.replace(CARD, card) for card in cards] if CARD in key else [key]
    found = []
    for name in names:
        steps = STEPS.search(name)
        keys = ([STEPS.sub(f"step{n}", name) for n in range(int(steps[1]), int(steps[2]) + 1)]
                if steps else [name])
        if all(k in got for k in keys):
            found.append((name, sum(float(got[k]) for k in keys) / len(keys)))
    return found or [(key, None)]


def _drift(name: str, got: float | None, row) -> str | None:
    if got is None:
        return f"{name}: missing (expected {row.value})"
    value, tolerance = float(row.value), float(row.tolerance)
    if row.bound == "floor":
        ok, expected = got >= value - tolerance, (f"at least {value - tolerance:.6g}: "
                                                  f"{value} - {tolerance}")
    elif row.bound == "ceiling":
        ok, expected = got <= value + tolerance, (f"at most {value + tolerance:.6g}: "
                                                  f"{value} + {tolerance}")
    else:
        ok, expected = abs(got - value) <= tolerance, f"{value} +- {tolerance}"
    return None if ok else f"{name}: {got} (expected {expected})"  # NaN: never ok


def _by_kind(keys) -> str:
    kinds = pd.Series([k.split("/")[0] for k in keys]).value_counts().sort_index()
    return ", ".join(f"{'job times' if kind == JOB[:-1] else kind} {n}"
                     for kind, n in kinds.items())


def check(values: pd.DataFrame, expected: Path, jobs: JobTimes | None) -> Verdict:
    """``values`` (collect's long table) and ``jobs`` (the run's job times, None without a
    run record) against ``expected`` and, for each card model the values were measured on,
    its card file where there is one."""
    seen = _observed(values, jobs)
    got = dict(zip(seen.key, seen.value, strict=True))
    cards = sorted(set(seen.card[seen.per_card]))
    files = [read_expected(expected)]
    files += [read_expected(card_file(expected, c)) for c in cards
              if card_file(expected, c).is_file()]
    verdict = Verdict([f.path for f in files])
    rows = pd.concat([f.rows for f in files], ignore_index=True)
    twice = rows.key[rows.key.duplicated()].tolist()
    if twice:
        raise ExpectedError(f"{verdict.files}: keys given in two files: {twice[:3]}")
    # Why the run's job times cannot be checked at all, if they cannot.
    no_jobs = ("no run record beside the results" if jobs is None else
               "the run held several card models" if jobs.card is None else None)
    not_run, unjudged = 0, 0
    for row in rows.itertuples():
        if row.key.startswith(JOB) and no_jobs:
            unjudged += 1
        elif row.key.startswith(JOB) and row.key not in got:
            not_run += 1
        else:
            for name, number in _resolve(row.key, got, cards):
                verdict.checked += 1
                problem = _drift(name, number, row)
                if problem:
                    verdict.drifted.append(problem)
    if unjudged:
        verdict.unchecked.append(f"{unjudged} job times ({no_jobs}: {RUN_RECORD})")
    if not_run:
        verdict.unchecked.append(f"{not_run} job times of jobs this run did not run (their "
                                 "results were kept from before)")
    elsewhere, others = _checked_on_cards(expected, seen)
    for card in cards:
        if not card_file(expected, card).is_file():
            left = seen.key[seen.per_card & (seen.card == card) & elsewhere]
            if len(left):
                verdict.unchecked.append(
                    f"{len(left)} values measured on {card} ({_by_kind(left)}), which "
                    f"{' and '.join(map(str, others))} check on another card: there is no "
                    f"{card_file(expected, card)}")
    return verdict


@dataclass
class PaperVerdict:
    """How many of the paper's numbers were reproduced (within their bands, by every
    measurement of ours compared with them), and each other one: outside its band (ours
    beside it), not measured by this run, or not compared (no band)."""

    numbers: int = 0
    reproduced: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    not_measured: list[str] = field(default_factory=list)
    not_compared: list[str] = field(default_factory=list)

    def message(self) -> str:
        parts = [f"{len(self.reproduced)} of the paper's {self.numbers} numbers reproduced "
                 "(within the bands qerl/report/paper.csv states)"
                 + (f": {', '.join(self.reproduced)}" if self.reproduced else "")]
        for what, names in (("outside their bands", self.outside),
                            ("not measured by this run", self.not_measured),
                            ("not compared (no band)", self.not_compared)):
            if names:
                parts.append(f"{what}: {'; '.join(names)}")
        return "; ".join(parts)

    def record(self) -> dict:
        return {"numbers": self.numbers, "reproduced": self.reproduced,
                "outside_band": self.outside, "not_measured": self.not_measured,
                "not_compared": self.not_compared, "message": self.message()}


def _paper_number(row) -> str:
    rank = f" r{row.lora_rank:g}" if pd.notna(row.lora_rank) else ""
    return f"{row.model} {row.metric} {row.method}{rank}"


def paper_verdict(comparisons: pd.DataFrame) -> PaperVerdict:
    """The verdict of ``comparisons`` (tables.paper_comparisons: every number of the paper,
    a row per measurement of ours compared with it)."""
    verdict = PaperVerdict()
    number = ["model", "metric", "method", "lora_rank"]
    for _, rows in comparisons.groupby(number, sort=False, dropna=False):
        name = _paper_number(rows.iloc[0])
        verdict.numbers += 1
        said = rows.reproduced.iloc[0]
        if said == "not measured":
            verdict.not_measured.append(name)
        elif said == "not compared":
            verdict.not_compared.append(name)
        elif (rows.reproduced == "yes").all():
            verdict.reproduced.append(name)
        else:
            verdict.outside.append(name + ": " + ", ".join(
                f"ours {r.ours:.4g} vs {r.paper:.4g} +- {r.band:g} ({r.setting}, {r.card})"
                for r in rows[rows.reproduced != "yes"].itertuples()))
    return verdict
