"""How a measurement is recorded: rows appended to a CSV under results/, each led by its
provenance (the date, the card and the library versions it was measured with). Benchmarks,
training runs and evaluations all use it."""

from __future__ import annotations

import csv
import importlib.metadata
import os
import platform
from datetime import datetime, timezone
from pathlib import Path


def card_name(device: str) -> str:
    """The GPU's name, or the CPU's model name."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def version(package: str) -> str:
    """The installed version of ``package`` (empty if it is not installed)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def provenance(device: str) -> dict:
    """The leading columns of every row."""
    import torch
    import transformers

    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "card": card_name(device),
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": version("triton"),
        "qerl": code_version(),
    }


def code_version() -> str:
    """qerl's version, and the commit it was built from where known (QERL_COMMIT: the
    workflow sets it from its checkout, the Docker image from its build)."""
    commit = os.environ.get("QERL_COMMIT")
    if not commit:
        return version("qerl")
    return f"{version('qerl')}+{commit[:12]}{'-dirty' if commit.endswith('-dirty') else ''}"


def per_card(name: str, card: str, suffix: str = ".csv") -> str:
    """The name of a results file of one card: NAME_CARD.csv, the card's spaces as
    underscores (as benchmarks write their CSVs and the report its figures)."""
    return f"{name}_{card.replace(' ', '_')}{suffix}"


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` to the CSV at ``path``, writing the header if the file is new. Rows
    with columns the file lacks (a benchmark that records more than it used to) rewrite it
    with the union of both, the old rows' new cells left empty, so no row is lost or shifted
    under another column's header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    old: list[dict] = []
    if path.is_file() and path.stat().st_size:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            if set(fields) <= set(header):
                with path.open("a", newline="") as out:
                    csv.DictWriter(out, fieldnames=header, lineterminator="\n").writerows(rows)
                return
            old = list(reader)
        fields = list(dict.fromkeys([*header, *fields]))
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows([*old, *rows])
    tmp.replace(path)
