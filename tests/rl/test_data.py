"""Tasks from local files (the hub's schemas) and the procedural arithmetic task."""

from __future__ import annotations

import json

import pytest

from qerl.rl.data import INSTRUCTION, LOCAL_FILES, DataError, arithmetic_problems, load_task
from tests.rl.test_rewards import DATA


@pytest.mark.parametrize(("name", "file", "rows", "first"), [
    ("gsm8k", "gsm8k_test.jsonl", 1319, "18"),
    ("gsm8k", "gsm8k_train_head200.jsonl", 200, "72"),
    ("math500", "math500_test.jsonl", 500, "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("dapo-math-17k", "dapo_math_17k_head200.jsonl", 200, "34"),
])
def test_local_files_load_as_conversational_prompts(name, file, rows, first):
    task = load_task(name, path=DATA / file)
    assert len(task) == rows and task[0]["answer"] == first
    message = task[0]["prompt"]
    assert len(message) == 1 and message[0]["role"] == "user"
    assert message[0]["content"].endswith(INSTRUCTION)
    assert len(load_task(name, path=DATA / file, limit=7)) == 7



def test_rows_keep_their_own_id_else_their_position(tmp_path):
    math500 = load_task("math500", path=DATA / "math500_test.jsonl", limit=2)
    assert math500["source_id"] == ["test/precalculus/807.json",
                                    "test/intermediate_algebra/1994.json"]
    file = tmp_path / "aime.jsonl"
    rows = [{"id": 60, "problem": "p", "answer": "1"}, {"problem": "no answer"},
            {"problem": "q", "answer": "2"}]
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_task("aime24", path=file)["source_id"] == ["60", "2"]
    assert load_task("arithmetic", size=3)["source_id"] == ["0", "1", "2"]


def test_an_unreachable_hub_names_the_local_way(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"--data gsm8k=FILE.*tests/data/gsm8k_test.jsonl"):
        load_task("gsm8k", split="test")
    for file in LOCAL_FILES:
        assert (DATA.parent.parent / file).is_file(), file

def test_bad_sources_are_refused_with_their_cause(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_task("gsm8k", path=tmp_path / "missing.jsonl")
    useless = tmp_path / "useless.jsonl"
    useless.write_text('{"text": "no question here"}\n{"question": "q", "answer": ""}\n')
    with pytest.raises(DataError, match="no usable rows"):
        load_task("gsm8k", path=useless)
    garbled = tmp_path / "garbled.jsonl"
    garbled.write_text("{not json\n")
    with pytest.raises(DataError, match="cannot read"):
        load_task("gsm8k", path=garbled)
    with pytest.raises(DataError, match="unknown task 'gsm9k'"):
        load_task("gsm9k")
    with pytest.raises(DataError, match="level must be 1 to 5"):
        load_task("arithmetic", level=6)


def test_arithmetic_is_reproducible_and_harder_by_level():
    assert arithmetic_problems(3, 50, seed=1) == arithmetic_problems(3, 50, seed=1)
    assert arithmetic_problems(3, 50, seed=1) != arithmetic_problems(3, 50, seed=2)
    sizes = [sum(len(q) for q, _ in arithmetic_problems(level, 200, 0)) for level in range(1, 6)]
    assert sizes == sorted(sizes)
    task = load_task("arithmetic", level=2, size=64, seed=0)
    assert len(task) == 64 and all(a.lstrip("-").isdigit() for a in task["answer"])


@pytest.mark.parametrize(("task", "rows", "first_id", "first_answer"), [
    ("aime24", 30, "60", "204"), ("aime25", 30, "0", "70"), ("amc23", 40, "0", "27.0")])
def test_the_competition_copies_load_with_their_ids(task, rows, first_id, first_answer):
    """AIME24/25 and AMC23 offline (tests/data/README.md): every problem, its own id where
    the file has one, and AMC's float golds graded as the integers they are."""
    from qerl.rl.rewards import is_correct

    data = load_task(task, path=DATA / f"{task}_test.jsonl", split=None)
    assert len(data) == rows
    assert (data[0]["source_id"], data[0]["answer"]) == (first_id, first_answer)
    if task == "amc23":
        assert is_correct("\\boxed{27}", data[0]["answer"])
