"""Rewards on the real data: every gold solution, given as a completion, scores 1.0; a
wrong final number scores 0; nothing a model can write makes them raise."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from qerl.rl.data import question_and_answer
from qerl.rl.rewards import RewardError, accuracy_reward, checked, format_reward
from tests.conftest import fresh_seed

DATA = Path(__file__).parent.parent / "data"


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


@pytest.mark.parametrize(("name", "solution"), [("gsm8k_test.jsonl", "answer"),
                                                ("math500_test.jsonl", "solution")])
def test_gold_solutions_score_one(name, solution):
    data = rows(name)
    answers = [question_and_answer(r)[1] for r in data]
    scores = accuracy_reward([r[solution] for r in data], answers)
    failures = [i for i, s in enumerate(scores) if s != 1.0]
    # All 1319 + 500 pass today; the issue allows 0.5%.
    assert len(failures) <= 0.005 * len(data), failures[:20]
    assert sum(format_reward([r[solution] for r in data])) == len(data)


def test_a_wrong_number_scores_zero():
    rng = random.Random(fresh_seed())
    data = rng.sample(rows("gsm8k_test.jsonl"), 100)
    answers = [question_and_answer(r)[1] for r in data]
    wrong = [f"Reasoning...\n#### {int(float(a)) + rng.randint(1, 9)}" for a in answers]
    assert accuracy_reward(wrong, answers) == [0.0] * len(data)
    boxed_wrong = [f"so it is $\\boxed{{{int(float(a)) - 1}}}$" for a in answers]
    assert accuracy_reward(boxed_wrong, answers) == [0.0] * len(data)


def test_any_completion_is_scored_without_raising():
    rng = random.Random(fresh_seed())
    garbage = ["", " ", "\\boxed{", "}}}{{{\\frac", "$$$$", "\x00\x01", "x" * 200_000,
               "\\boxed{" * 500, "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(5000)),
               "1/0 = \\boxed{1/0}", "\\boxed{\\sqrt{-1}}", "#### ", "#### ####"]
    scores = accuracy_reward(garbage, ["42"] * len(garbage))
    assert len(scores) == len(garbage) and all(s in (0.0, 1.0) for s in scores)
    assert format_reward(garbage)[0] == 0.0


def test_conversational_completions_and_latex_answers():
    completions = [[{"role": "assistant", "content": "Thus $x = \\boxed{\\frac{1}{2}}$."}],
                   [{"role": "assistant", "content": "The answer is \\boxed{0.5}"}],
                   [{"role": "assistant", "content": "I think 3"}]]
    assert accuracy_reward(completions, ["\\frac12"] * 3) == [1.0, 1.0, 0.0]
    assert format_reward(completions) == [1.0, 1.0, 0.0]


def test_checked_names_the_reward_that_returned_nan():
    def broken(completions, **_):
        return [1.0, math.nan]

    with pytest.raises(RewardError, match="broken returned nan for completion 1"):
        checked(broken)(["a", "b"])
    with pytest.raises(RewardError, match="3 completions"):
        checked(broken)(["a", "b", "c"])
    assert checked(accuracy_reward)(["\\boxed{2}"], answer=["2"]) == [1.0]


@pytest.mark.parametrize("completion", [r"\boxed{\text{27}}", r"\boxed{\mathbf{27}}",
                                        r"\boxed{27\%}", r"\boxed{27}", r"\boxed{27.0}",
                                        "#### 27", r"\boxed{28}"])
def test_an_integer_gold_stored_as_a_float_grades_as_the_integer(completion):
    """AMC23 stores 27 as "27.0": every completion scores as against "27"."""
    expected = accuracy_reward([completion], ["27"])
    assert accuracy_reward([completion] * 3, ["27.0", " 27.00 ", "+27."]) == expected * 3
    assert accuracy_reward([r"\boxed{27}"], ["27.5"]) == [0.0]  # not an integer
