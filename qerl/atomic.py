"""Output directories that appear only once complete, and never replace what a user made."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qerl.errors import QerlError


@contextmanager
def atomic_directory(out: str | Path, overwrite: bool, marker: str) -> Iterator[Path]:
    """Yield a temporary directory beside ``out``, renamed to ``out`` when the block ends
    without error and removed otherwise. An existing ``out`` is replaced only with
    ``overwrite`` and only if it is empty or an earlier output of ours (holds ``marker``):
    never a source model or anything else a user made."""
    out = Path(out)
    if out.exists():
        if not overwrite:
            raise QerlError(f"{out} already exists; pass --overwrite to replace it")
        if not out.is_dir() or (any(out.iterdir()) and not (out / marker).exists()):
            raise QerlError(f"{out} is not an output of qerl (no {marker}); refusing to "
                            "replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
