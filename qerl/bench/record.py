"""How benchmark results are recorded: rows appended to a CSV under results/, each naming
the date, the card and the library versions it was measured with."""

from __future__ import annotations

import csv
import importlib.metadata
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch


def card_name(device: str) -> str:
    """The GPU's name, or the CPU's model name."""
    if device.startswith("cuda"):
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
    import transformers

    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "card": card_name(device),
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": version("triton"),
    }


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` to the CSV at ``path``, writing the header if the file is new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerows(rows)
