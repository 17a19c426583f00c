"""Rows appended to a results CSV keep their columns: a benchmark that records a new column
rewrites the file with the union, old rows' new cells empty, nothing lost or shifted."""

from __future__ import annotations

import pandas as pd
import pytest

from qerl.record import append_rows, provenance


def test_rows_with_new_columns_widen_the_file_instead_of_shifting_it(tmp_path):
    path = tmp_path / "bench" / "x.csv"
    append_rows(path, [{"card": "A", "M": 1, "us": 2.0}])
    append_rows(path, [{"card": "A", "M": 2, "us": 3.0}])
    append_rows(path, [{"card": "B", "M": 4, "path": "cuda", "us": 5.0}])  # one more column
    append_rows(path, [{"us": 6.0, "card": "C"}])  # fewer, in another order
    rows = pd.read_csv(path)
    assert list(rows.columns) == ["card", "M", "us", "path"]
    assert rows.card.tolist() == ["A", "A", "B", "C"]
    assert rows.us.tolist() == [2.0, 3.0, 5.0, 6.0]
    assert rows.path.isna().tolist() == [True, True, False, True]
    assert rows.M.isna().tolist() == [False, False, False, True]
    assert not path.with_name("x.csv.tmp").exists()


def test_provenance_names_the_card_and_versions():
    row = provenance("cpu")
    assert {"date", "card", "device", "torch", "transformers", "triton"} <= set(row)
    assert row["card"] and row["device"] == "cpu"


def test_provenance_names_the_code_that_ran(monkeypatch):
    """Runs of two versions of qerl can differ by more than their seeds do (the science
    study's two batches): every row says which it was, with the workflow's commit."""
    from qerl.record import version

    monkeypatch.delenv("QERL_COMMIT", raising=False)
    assert provenance("cpu")["qerl"].startswith(version("qerl")) and version("qerl")
    monkeypatch.setenv("QERL_COMMIT", "8333badc8cc252e518d1be265946552e316f8c86")
    assert provenance("cpu")["qerl"] == f"{version('qerl')}+8333badc8cc2"
    # A checkout with changes the commit lacks says so (the workflow's "-dirty").
    monkeypatch.setenv("QERL_COMMIT", "8333badc8cc252e518d1be265946552e316f8c86-dirty")
    assert provenance("cpu")["qerl"] == f"{version('qerl')}+8333badc8cc2-dirty"


def test_the_source_digest_names_the_code_not_its_place(tmp_path):
    """The same files give the same digest wherever they lie (a checkout, an installed
    wheel); a changed byte, a renamed file or a new module change it; bytecode does not."""
    from qerl.record import source_digest

    def tree(name: str, files: dict[str, str]):
        for rel, text in files.items():
            (tmp_path / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / rel).write_text(text)
        return tmp_path / name

    files = {"a.py": "x = 1\n", "k/g.cu": "// kernel\n", "k/c.json": "{}"}
    same = source_digest(tree("one", files))
    assert source_digest(tree("two", files)) == same
    assert source_digest(tree("cached", {**files, "__pycache__/a.pyc": "\0"})) == same
    assert source_digest(tree("byte", {**files, "a.py": "x = 2\n"})) != same
    assert source_digest(tree("moved", {"b.py": "x = 1\n", "k/g.cu": "// kernel\n",
                                        "k/c.json": "{}"})) != same
    assert source_digest(tree("more", {**files, "new.py": ""})) != same
    assert len(same) == 12 and provenance("cpu")["qerl_source"] == source_digest()


def test_qerl_version_names_the_code_installed(capsys, monkeypatch):
    """`qerl --version` says what a row's qerl and qerl_source columns would say."""
    from qerl.cli import main
    from qerl.record import code_version, source_digest

    monkeypatch.setenv("QERL_COMMIT", "8333badc8cc252e518d1be265946552e316f8c86")
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    said = capsys.readouterr().out
    assert said.startswith(f"qerl {code_version()} (source {source_digest()}, ")
    assert "+8333badc8cc2" in said


def test_a_checkout_names_its_commit(tmp_path, monkeypatch):
    """Run from a git checkout (an editable install), qerl's version carries the checkout's
    commit, "-dirty" once a tracked file changes; an installed copy (no .git) its version
    alone."""
    import shutil
    import subprocess

    from qerl.record import checkout_commit, code_version, version

    if shutil.which("git") is None:
        pytest.skip("no git")

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True,
                              capture_output=True, text=True).stdout.strip()

    assert checkout_commit(tmp_path) is None
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    head = git("rev-parse", "HEAD")
    checkout_commit.cache_clear()
    assert checkout_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    checkout_commit.cache_clear()
    assert checkout_commit(tmp_path) == f"{head}-dirty"
    monkeypatch.delenv("QERL_COMMIT", raising=False)
    monkeypatch.setattr("qerl.record.checkout_commit", lambda: head)
    assert code_version() == f"{version('qerl')}+{head[:12]}"
