"""Output directories that appear only once complete, never replace what a user made, and
are written by one process at a time."""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qerl.errors import QerlError


def make_directory(path: str | Path, what: str = "output") -> Path:
    """``path`` made with its parents where missing; a path that cannot be a directory
    (under a file, on a read-only or virtual filesystem, without permission) is refused,
    naming what is in the way."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        there = next(p for p in (path, *path.parents) if p.exists())
        why = (f"{there} is a file, not a directory" if not there.is_dir() else
               f"{there} takes no new directory ({e.strerror or e})")
        raise QerlError(f"cannot make the {what} directory {path}: {why}") from None
    return path


def lock_path(out: Path) -> Path:
    """The hidden lock file beside ``out`` (removed when its holder ends; a holder killed
    by a signal leaves it behind, unlocked, for the next claim to take)."""
    return out.parent / f".{out.name}.lock"


@contextmanager
def claim(out: str | Path, what: str) -> Iterator[None]:
    """Hold ``out`` for this process while the block runs. Of two processes writing the same
    output, the second fails at once with a message naming the first. The lock is the
    operating system's (flock): a holder that dies, even by kill -9, releases it, so a
    rerun after a crash proceeds (and resumes) without anyone removing a file."""
    out = Path(out).resolve()  # one lock for every spelling of the directory
    if not out.name:
        raise QerlError(f"{out} cannot be an output directory")
    make_directory(out.parent, "output's parent")
    lock = lock_path(out)
    while True:
        try:  # never through a link: the lock would write into whatever it points at
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            why = ("is not a plain file" if lock.is_symlink() or lock.exists()
                   else f"cannot be made ({e.strerror or e}): {out.parent} takes no output")
            raise QerlError(f"{lock} (the lock beside {out}) {why}") from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise QerlError(f"{lock} (the lock beside {out}) is not a plain file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise QerlError(f"{out} is being written by another process ({holder}); wait "
                            "for it to end, or write to another directory") from None
        # A holder that just ended removed the file we opened: lock the one now there.
        if _same_file(fd, lock):
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"what": what, "pid": os.getpid(),
                                  "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        yield
    finally:
        lock.unlink(missing_ok=True)  # still locked: no one holds the file being removed
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _holder(fd: int) -> str:
    try:
        h = json.loads(os.pread(fd, 4096, 0))
        return f"{h['what']}, pid {h['pid']} on {h['host']}, since {h['since']}"
    except (ValueError, KeyError, TypeError):
        return "it is starting"


@contextmanager
def atomic_directory(out: str | Path, overwrite: bool, marker: str,
                     what: str = "qerl") -> Iterator[Path]:
    """Yield a temporary directory beside ``out``, renamed to ``out`` when the block ends
    without error and removed otherwise, with ``out`` claimed throughout: of two commands
    writing it at once, one proceeds and the other fails at once. An existing ``out`` is
    replaced only with ``overwrite`` and only if it is empty or an earlier output of ours
    (holds ``marker``): never a source model or anything else a user made."""
    out = Path(out).resolve()
    with claim(out, what):
        _check_replaceable(out, overwrite, marker)
        for pattern in ("partial", "old"):  # what a killed writer left
            for stale in out.parent.glob(f".{glob.escape(out.name)}.{pattern}-*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
        tmp.mkdir()
        try:
            yield tmp
            # Checked again: the block may have run for minutes, and something may now be
            # there. The old output goes aside first, so a failure loses neither.
            _check_replaceable(out, overwrite, marker)
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            if out.exists():
                out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _check_replaceable(out: Path, overwrite: bool, marker: str) -> None:
    if not out.exists():
        return
    if not overwrite:
        raise QerlError(f"{out} already exists; pass --overwrite to replace it")
    if not out.is_dir() or (any(out.iterdir()) and not (out / marker).exists()):
        raise QerlError(f"{out} is not an output of qerl (no {marker}); refusing to "
                        "replace it")
