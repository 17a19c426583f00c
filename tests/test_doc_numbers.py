"""The documents quote no measurement that ``qerl report`` did not write. Every ratio (1.45x),
time (7.8 s, 12 ms, 9 us), memory size (9.5 GB), throughput (tokens/s, TB/s) and percentage
typed in README.md, docs/*.md, kernels/DESIGN.md, workflows/README.md or a README under
results/ must be a number of a generated table that its paragraph (or list item) links —
`results/tables/NAME.md`, or NAME.md — or of a values.csv row whose key it quotes in
backticks, at the rounding and in the unit the table has; else the test names file:line.
A percentage may be the table's fraction (1.59% for 0.0159). A table pasted between
``<!-- results/tables/NAME.md -->`` markers is checked against its file by
tests/test_readme.py and skipped here. Numbers that measure nothing (r32, 16 weights,
batch 128, 2048 tokens, 16 x 8 x 1024, versions) carry none of those units, a number
hyphenated to a name is the name's (qerl-10x), and a card's specification is allowed by
name below.

Refresh the tables with ``qerl report --results results``; a number in no table is linked
instead of typed, or goes."""

from __future__ import annotations

import csv
import re
from functools import cache

import pytest

from tests.test_workflow import ROOT

TABLES = ROOT / "results" / "tables"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "kernels" / "DESIGN.md", ROOT / "workflows" / "README.md",
             *sorted((ROOT / "results").glob("**/README.md"))]

# A card's specification, not a measurement: NVIDIA's data sheets.
SPECIFICATIONS = {
    ("80", "GB"): "an H100's memory",
    ("141", "GB"): "an H200's memory",
    ("3.35", "TB/s"): "an H100 SXM's HBM3 bandwidth",
    ("4.8", "TB/s"): "an H200's HBM3e bandwidth",
}

UNITS = r"TB/s|GB/s|TFLOP/s|tokens/s|tok/s|GiB|GB|ms|us|µs|μs|ns|s|seconds?|minutes?|hours?|%"
_NUMBER = r"\d+(?:\.\d+)?"
# One number, or a run of them sharing the unit after the last: "0.97-1.95x", "1.7 / 2.1 s",
# "40.5 and 39.5 tokens/s"; a number hyphenated to a word is part of a name (qerl-10x).
_RUN = rf"(?<![\w.^/=@])(?<!\w-){_NUMBER}(?:\s*(?:/|-|–|to|and|vs\.?|against)\s*{_NUMBER})*"
QUANTITY = re.compile(
    rf"(?P<run>{_RUN})"
    # a ratio: no space before x (16 x 8 x 1024 is a shape), no number after it (3584x37888)
    rf"(?:(?P<ratio>x(?!\w)(?!\s*\d)|\s?×(?!\s*\d))|\s?(?P<unit>{UNITS})(?![\w/]))"
)
GENERATED = re.compile(r"<!-- (results/tables/\S+) -->\n.*?<!-- /\1 -->", re.DOTALL)
LINKED_TABLE = re.compile(r"\b(\w+)\.md\b")
QUOTED = re.compile(r"`([^`]+)`")


def quantities(text: str) -> list[tuple[str, str]]:
    """Each measured-looking number of ``text`` with its unit: [(number, unit)]."""
    found = []
    for match in QUANTITY.finditer(text):
        unit = "x" if match["ratio"] else match["unit"]
        found += [(number, unit) for number in re.findall(_NUMBER, match["run"])]
    return found


def blocks(text: str) -> list[list[tuple[int, str]]]:
    """The paragraphs and list items of a Markdown text as [(line number, line)]; a table
    joins the block before it (its caption). Generated blocks are left out."""
    text = GENERATED.sub(lambda m: "\n" * m[0].count("\n"), text)
    found: list[list[tuple[int, str]]] = []
    current: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or re.match(r"\s*(?:[-*]|\d+\.)\s|#", line):
            if current:
                found.append(current)
            current = []
        if not line.strip():
            continue
        if not current and line.lstrip().startswith("|") and found:
            current = [(0, caption) for _, caption in found[-1]]  # its links, not its lines
        current.append((number, line))
    if current:
        found.append(current)
    return found


# A cell of a generated table: a number, or a range of two (status.md's "0.97-1.95x").
CELL = re.compile(r"(-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)(?:-(\d+(?:\.\d+)?))?(?:x| GB peak)?")


@cache
def table_numbers(name: str) -> tuple[float, ...]:
    """Every number in the cells of results/tables/NAME.csv, ``qerl report``'s
    full-precision copy of NAME.md."""
    numbers = []
    with open(TABLES / f"{name}.csv", newline="") as f:
        for row in csv.DictReader(f):
            for cell in row.values():
                if match := CELL.fullmatch((cell or "").strip()):
                    numbers += [float(n) for n in match.groups() if n is not None]
    return tuple(numbers)


@cache
def values_by_key() -> dict[str, float]:
    """results/tables/values.csv: each number by its key."""
    with open(TABLES / "values.csv", newline="") as f:
        return {row["key"]: float(row["value"]) for row in csv.DictReader(f)}


def sources(block: str) -> list[float]:
    """The numbers a block may quote: its linked tables' and its quoted values.csv keys'."""
    numbers: list[float] = []
    for name in dict.fromkeys(LINKED_TABLE.findall(block)):
        if (TABLES / f"{name}.csv").is_file():
            numbers += table_numbers(name)
    keys = values_by_key()
    numbers += [keys[quoted] for quoted in QUOTED.findall(block) if quoted in keys]
    return numbers


def rounds_to(number: str, unit: str, numbers: list[float]) -> bool:
    """Whether one of ``numbers`` rounds to ``number`` at its decimals (a percentage may be
    a fraction)."""
    half = 0.5 * 10 ** -len(number.partition(".")[2])
    targets = [(float(number), half)]
    if unit == "%":
        targets.append((float(number) / 100, half / 100))
    return any(abs(value - target) <= h * (1 + 1e-9) for target, h in targets
               for value in numbers)


def unsourced(text: str) -> list[tuple[int, str]]:
    """(line, quantity) for each quantity of ``text`` that no table its block links holds
    and no specification names."""
    bad = []
    for block in blocks(text):
        numbers = sources("\n".join(line for _, line in block))
        for number, line in block:
            for value, unit in quantities(line) if number else []:  # 0: a caption's
                if (value, unit) not in SPECIFICATIONS and not rounds_to(value, unit, numbers):
                    bad.append((number, value + unit if unit in ("x", "%") else f"{value} {unit}"))
    return bad


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_quoted_measurement_is_in_a_table_it_links(document):
    bad = unsourced(document.read_text())
    where = document.relative_to(ROOT)
    assert not bad, "numbers in no results/tables table their paragraph links:\n" + \
        "\n".join(f"{where}:{line}: {quantity}" for line, quantity in bad)


@pytest.mark.parametrize("text, expected", [
    ("NVFP4 is 1.45x BF16", [("1.45", "x")]),
    ("0.93× of it", [("0.93", "x")]),
    ("a step of 7.8 s, a kernel of 12 ms and 9 us", [("7.8", "s"), ("12", "ms"), ("9", "us")]),
    ("9.5 GB at peak, 0.93 GiB more", [("9.5", "GB"), ("0.93", "GiB")]),
    ("6-12% slower", [("6", "%"), ("12", "%")]),
    ("1.73 / 1.41 / 1.10x at batch 1 / 16 / 32", [("1.73", "x"), ("1.41", "x"),
                                                  ("1.10", "x")]),
    ("3563 tokens/s at 3.7 TB/s", [("3563", "tokens/s"), ("3.7", "TB/s")]),
    ("7.809 s and 10.15 s, 40.5 and 39.5 tokens/s, 8.5 vs 13.0 ms",
     [("7.809", "s"), ("10.15", "s"), ("40.5", "tokens/s"), ("39.5", "tokens/s"), ("8.5", "ms"),
      ("13.0", "ms")]),
    ("an H100 80GB HBM3, 16 minutes later", [("80", "GB"), ("16", "minutes")]),
])
def test_measurements_are_found(text, expected):
    assert quantities(text) == expected


@pytest.mark.parametrize("text", [
    "LoRA r32 on 16 weights at batch 128, 2048 tokens",
    "16 x 8 x 1024 and G8 x L2048 x P2, a 3584x37888 weight, 8 x 2112 activations",
    "vLLM 0.26 on torch 2.11 for sm_90, 0.5625 bytes a weight, 2^14, G=8, avg@4",
    "100 steps of 4 stages, 3 splits, 1 KB of codes",
    "the variants qerl-10x and qerl-aqn-10x",
])
def test_settings_are_not_measurements(text):
    assert quantities(text) == []


def test_a_number_passes_at_its_own_rounding():
    assert rounds_to("1.44", "x", [1.4449]) and not rounds_to("1.45", "x", [1.4449])
    assert rounds_to("1.4", "x", [1.4449]) and not rounds_to("1.5", "x", [1.4449])
    assert rounds_to("1.59", "%", [0.0159]) and rounds_to("72.3", "%", [72.3])
    assert not rounds_to("7.8", "ms", [0.0078])  # in the table's unit, as it prints it


def _a_rollout_ratio() -> str:
    with open(TABLES / "rollout.csv", newline="") as f:
        ratio = next(float(r["nvfp4/bf16"]) for r in csv.DictReader(f) if r["nvfp4/bf16"])
    return f"{ratio:.2f}x"


def test_a_number_needs_a_table_its_paragraph_links():
    quoted = _a_rollout_ratio()
    text = (f"Linked: {quoted} (`results/tables/rollout.md`).\n\n"
            f"Not linked: {quoted}.\n\n"
            f"- an item linking rollout.md: {quoted}\n- the next item: {quoted}\n\n"
            "<!-- results/tables/x.md -->\n| 2.0x |\n<!-- /results/tables/x.md -->\n"
            "On an H100 80GB HBM3 (`status.md`): 0.5 s\n")
    assert unsourced(text) == [(3, quoted), (6, quoted), (11, "0.5 s")]


def test_a_table_takes_its_captions_links_and_a_quoted_key_its_value():
    quoted = _a_rollout_ratio()
    text = f"From `rollout.md`:\n\n| a | b |\n|---|---|\n| {quoted} | 9.99x |\n"
    assert unsourced(text) == [(5, "9.99x")]
    key, value = next((k, v) for k, v in values_by_key().items() if v > 1)
    assert unsourced(f"`{key}`: {value:.3f} s\n\n{value:.3f} s\n") == [(3, f"{value:.3f} s")]
