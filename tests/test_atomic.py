"""One writer per output: of two processes claiming the same output directory, the second
fails at once naming the first; a holder that dies (kill -9) leaves nothing to clean up;
two quantize/export writers never both succeed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from qerl.atomic import atomic_directory, claim, lock_path, make_directory
from qerl.errors import QerlError

HOLD = """
import sys, time
from pathlib import Path
from qerl.atomic import claim
with claim(Path(sys.argv[1]), "qerl train"):
    Path(sys.argv[2]).touch()
    time.sleep(60)
"""


def holder(out: Path) -> subprocess.Popen:
    """A process that claims ``out`` and holds it (until killed)."""
    ready = out.parent / f"{out.name}.ready-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out), str(ready)])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, "the holder died before claiming"
        assert time.monotonic() < deadline, "the holder never claimed"
        time.sleep(0.05)
    return proc


def test_a_second_writer_fails_at_once_naming_the_first(tmp_path):
    out = tmp_path / "run"
    proc = holder(out)
    try:
        start = time.monotonic()
        with (pytest.raises(QerlError, match=rf"{out} is being written by another process "
                                             rf"\(qerl train, pid {proc.pid} on "),
              claim(out, "qerl eval")):
            pass
        assert time.monotonic() - start < 5, "waited instead of failing"
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_holder_releases_the_output(tmp_path):
    out = tmp_path / "run"
    proc = holder(out)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert lock_path(out).exists()  # left behind, unlocked
    with claim(out, "qerl train"):  # the rerun after a crash proceeds
        assert lock_path(out).exists()
    assert not lock_path(out).exists()


def test_claims_are_per_output_and_released_on_exit(tmp_path):
    """Two outputs held at once by one process each have their lock; a third claim of
    either fails (flock locks an open file, so even this process's second open is refused),
    and on exit both locks are gone and the outputs free."""
    a, b = tmp_path / "a", tmp_path / "b"
    with claim(a, "x"), claim(b, "x"):
        assert lock_path(a).is_file() and lock_path(b).is_file()
        for held in (a, b):
            with pytest.raises(QerlError, match=f"{held} is being written"), claim(held, "y"):
                pass
    assert not lock_path(a).exists() and not lock_path(b).exists()
    with claim(a, "x"):
        assert lock_path(a).is_file()


def test_an_output_that_cannot_be_a_directory_is_refused_by_name(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(QerlError, match=f"{tmp_path / 'file'} is a file, not a directory"):
        make_directory(tmp_path / "file" / "out")
    with pytest.raises(QerlError, match=f"{tmp_path / 'file'} is a file, not a directory"), \
            claim(tmp_path / "file" / "out", "x"):
        pass
    assert make_directory(tmp_path / "new" / "out").is_dir()


def test_overwrite_never_replaces_an_output_being_written(tmp_path):
    out = tmp_path / "quantized"
    out.mkdir()
    (out / "marker").write_text("")
    proc = holder(out)
    try:
        with (pytest.raises(QerlError, match="being written by another process"),
              atomic_directory(out, overwrite=True, marker="marker")):
            pass
        assert (out / "marker").exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_writers_partial_directory_is_cleared(tmp_path):
    out = tmp_path / "quantized"
    stale = tmp_path / ".quantized.partial-999999"
    stale.mkdir()
    (stale / "half-written").write_text("x")
    with atomic_directory(out, overwrite=False, marker="marker") as tmp:
        (tmp / "marker").write_text("")
    assert (out / "marker").exists() and not stale.exists()


def test_glob_characters_in_a_name_touch_no_other_output(tmp_path):
    other = tmp_path / ".run1.partial-999999"  # another output's (run1) partial directory
    other.mkdir()
    with atomic_directory(tmp_path / "run[1]", overwrite=False, marker="m") as tmp:
        (tmp / "m").write_text("")
    assert other.is_dir() and (tmp_path / "run[1]" / "m").exists()


def test_a_lock_that_is_a_link_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("a user's file")
    lock_path(tmp_path / "run").symlink_to(victim)
    with pytest.raises(QerlError, match="is not a plain file"), claim(tmp_path / "run", "x"):
        pass
    assert victim.read_text() == "a user's file"


def test_every_spelling_of_a_directory_takes_the_same_lock(tmp_path, monkeypatch):
    (tmp_path / "real" / "run").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "run")
    monkeypatch.chdir(tmp_path / "real" / "run")
    proc = holder(tmp_path / "link")
    try:
        for spelling in (Path("."), tmp_path / "real" / "run",
                         tmp_path / "real" / "x" / ".." / "run"):
            with pytest.raises(QerlError, match="being written"), claim(spelling, "x"):
                pass
    finally:
        proc.kill()
        proc.wait()


def test_an_output_that_appeared_meanwhile_is_not_replaced(tmp_path):
    out = tmp_path / "q"
    with (pytest.raises(QerlError, match="already exists"),
          atomic_directory(out, overwrite=False, marker="m") as tmp):
        (tmp / "m").write_text("")
        out.mkdir()  # someone else's, made while we worked
        (out / "theirs").write_text("keep")
    assert (out / "theirs").read_text() == "keep"
