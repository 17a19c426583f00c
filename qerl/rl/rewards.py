"""Verifiable math rewards (math-verify), in TRL's reward-function form:
``fn(completions, **dataset_columns) -> list[float]``.

    accuracy_reward   1.0 when the completion's final answer equals the gold ``answer``
    format_reward     1.0 when the completion states a final answer in \\boxed{} (or #### N)

GSM8K-style ``#### N`` lines are rewritten to ``\\boxed{N}`` before parsing: math-verify
ignores ``####`` and would otherwise latch onto an earlier number. A completion that does
not parse — empty, huge, garbage — scores 0; it never raises. ``checked`` wraps any reward
function so that a NaN, an infinity or a wrong count stops training with the function's
name instead of turning into a silent average.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from qerl.errors import QerlError

HASHES = re.compile(r"####\s*([^\n]+)")
# A gold integer stored as a float ("27.0", AMC23's schema): graded as the integer, which
# math-verify matches in more forms (\text{27}, \mathbf{27}, 27\%).
INTEGER_FLOAT = re.compile(r"\s*([+-]?\d+)\.0*\s*")
BOXED = re.compile(r"\\boxed\s*\{|\\fbox\s*\{")


class RewardError(QerlError):
    """A reward function returned something training cannot use."""


def completion_text(completion) -> str:
    """A completion as text: a string, or TRL's conversational [{"role", "content"}, ...]
    (the last message's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    raise RewardError(f"a completion must be a string or a list of messages, got "
                      f"{type(completion).__name__}")


def _hashes_to_boxed(text: str) -> str:
    return HASHES.sub(lambda m: "\\boxed{" + m.group(1).strip().replace(",", "") + "}", text)


def parse_answer(text: str) -> list:
    """math-verify's parse of a completion's final answer ([] when there is none)."""
    from math_verify import parse

    try:
        return parse(_hashes_to_boxed(text))
    except Exception:  # math-verify raises on some malformed LaTeX despite raise_on_error=False
        return []


def parse_gold(answer: str) -> list:
    """The gold answer (a bare final answer such as ``72`` or ``\\frac{1}{2}``; an integer
    written as a float, ``27.0``, as the integer)."""
    from math_verify import parse

    integer = INTEGER_FLOAT.fullmatch(str(answer))
    text = integer.group(1) if integer else str(answer).strip()
    gold = parse("\\boxed{" + text + "}")
    if not gold:
        raise RewardError(f"the gold answer {answer!r} does not parse")
    return gold


def is_correct(completion_text_: str, answer: str) -> bool:
    return matches(parse_answer(completion_text_), answer)


def matches(predicted: list, answer: str) -> bool:
    """Whether a parsed final answer (``parse_answer``) equals the gold ``answer``."""
    from math_verify import verify

    if not predicted:
        return False
    try:
        return bool(verify(parse_gold(answer), predicted))
    except RewardError:
        raise
    except Exception:
        return False


def accuracy_reward(completions, answer, **_) -> list[float]:
    """1.0 for a completion whose final answer equals its row's gold ``answer``."""
    return [float(is_correct(completion_text(c), a))
            for c, a in zip(completions, answer, strict=True)]


def format_reward(completions, **_) -> list[float]:
    """1.0 for a completion that gives a final answer in \\boxed{...} or a #### line."""
    return [float(bool(BOXED.search(t) or HASHES.search(t)))
            for t in map(completion_text, completions)]


REWARDS: dict[str, Callable] = {"accuracy": accuracy_reward, "format": format_reward}


def checked(fn: Callable) -> Callable:
    """``fn`` that raises RewardError, naming ``fn``, on a NaN/inf reward or a count that
    does not match the completions."""
    name = getattr(fn, "__name__", repr(fn))

    def reward(completions, **kwargs) -> list[float]:
        values = fn(completions=completions, **kwargs)
        if len(values) != len(completions):
            raise RewardError(f"reward {name} returned {len(values)} values for "
                              f"{len(completions)} completions")
        bad = [i for i, v in enumerate(values) if v is None or not math.isfinite(float(v))]
        if bad:
            raise RewardError(f"reward {name} returned {values[bad[0]]} for completion "
                              f"{bad[0]} (of {len(bad)} non-finite values)")
        return [float(v) for v in values]

    reward.__name__ = name
    return reward
