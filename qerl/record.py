"""How a measurement is recorded: rows appended to a CSV under results/, each led by its
provenance (the date, the card and the library versions it was measured with). Benchmarks,
training runs and evaluations all use it."""

from __future__ import annotations

import csv
import functools
import hashlib
import importlib.metadata
import os
import platform
import secrets
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from qerl.atomic import make_directory


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
        "qerl_source": source_digest(),
        "run": run_id(),
    }


@functools.cache
def run_id() -> str:
    """The id of this invocation, the same in every row it writes: a ratio pairs rows of one
    run by it (qerl.report.collect.different_runs), not by their dates."""
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def code_version() -> str:
    """qerl's version, and the commit it was built from where known: QERL_COMMIT (the
    workflow sets it from its checkout, the Docker image from its build), else the commit of
    the checkout qerl runs from (``checkout_commit``)."""
    commit = os.environ.get("QERL_COMMIT") or checkout_commit()
    if not commit:
        return version("qerl")
    return f"{version('qerl')}+{commit[:12]}{'-dirty' if commit.endswith('-dirty') else ''}"


@functools.cache
def checkout_commit(root: Path | None = None) -> str | None:
    """The commit of the git checkout at ``root`` (default: the folder above the running
    package, where an editable install leaves it), "-dirty" when tracked files differ from
    it; None for an installed copy (no .git there) or where git cannot say."""
    root = Path(__file__).resolve().parents[1] if root is None else Path(root)
    if not (root / ".git").exists():
        return None

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):  # no git, or a hung one
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if not head:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return head + ("-dirty" if dirty else "")


# The files a qerl wheel carries (setuptools' packages and package-data in pyproject.toml).
SOURCE_SUFFIXES = frozenset({".py", ".cu", ".cuh", ".json", ".csv"})


@functools.cache
def source_digest(root: Path | None = None) -> str:
    """12 hex digits of SHA-256 over a qerl source tree's files (``root``: a checkout's
    qerl/, by default the package that is running), their paths below it and their bytes.
    The commit in ``code_version`` is a label the workflow or an image hands on; this
    names the code itself, so that the rows of an installed qerl older than the checkout
    that labels them can be told apart (the workflow refuses such a pair)."""
    root = Path(__file__).parent if root is None else Path(root)
    digest = hashlib.sha256()
    files = sorted(Path(folder, name)  # kernels/ is a link in a checkout: followed
                   for folder, _, names in os.walk(root, followlinks=True)
                   if "__pycache__" not in Path(folder).parts
                   for name in names if Path(name).suffix in SOURCE_SUFFIXES)
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def per_card(name: str, card: str, suffix: str = ".csv") -> str:
    """The name of a results file of one card: NAME_CARD.csv, the card's spaces as
    underscores (as benchmarks write their CSVs and the report its figures)."""
    return f"{name}_{card.replace(' ', '_')}{suffix}"


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` to the CSV at ``path``, writing the header if the file is new. Rows
    with columns the file lacks (a benchmark that records more than it used to) rewrite it
    with the union of both, the old rows' new cells left empty, so no row is lost or shifted
    under another column's header."""
    make_directory(path.parent)
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
