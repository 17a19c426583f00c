"""Training and evaluation tasks as TRL datasets: a conversational ``prompt`` (one user
message, the question plus the instruction to box the answer, so each model's own chat
template renders it) and the gold final ``answer`` that the rewards check.

    load_task("gsm8k")                                   # the hub (openai/gsm8k, main)
    load_task("gsm8k", path="data/gsm8k_train.jsonl")    # the same schema, a local file
    load_task("arithmetic", level=2, size=512, seed=0)   # procedural, for small models

Hub names: gsm8k (openai/gsm8k), math500 (HuggingFaceH4/MATH-500), dapo-math-17k
(BytedTsinghua-SIA/DAPO-Math-17k), bigmath (SynthLabsAI/Big-Math-RL-Verified), aime24
(HuggingFaceH4/aime_2024), aime25 (math-ai/aime25), amc23 (math-ai/amc23). A local
.jsonl/.json/.parquet file of any of these schemas works in place of the hub, or of any
schema with ``fields`` naming its question and answer columns.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from qerl.errors import QerlError

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class DataError(QerlError):
    """A dataset is missing, unreadable or has no usable rows."""


@dataclass(frozen=True)
class HubTask:
    repo: str
    config: str | None = None
    split: str = "train"  # what evaluation reads when no split is given


HUB = {
    "gsm8k": HubTask("openai/gsm8k", "main", "test"),
    "math500": HubTask("HuggingFaceH4/MATH-500", split="test"),
    "dapo-math-17k": HubTask("BytedTsinghua-SIA/DAPO-Math-17k"),
    "bigmath": HubTask("SynthLabsAI/Big-Math-RL-Verified"),
    "aime24": HubTask("HuggingFaceH4/aime_2024"),
    "aime25": HubTask("math-ai/aime25", split="test"),
    "amc23": HubTask("math-ai/amc23", split="test"),
}
TASKS = (*HUB, "arithmetic")
ID_COLUMNS = ("id", "unique_id", "problem_id", "ID")  # the schemas' own problem ids
# Copies in the repository, for machines without the hub (provenance: tests/data/README.md).
LOCAL_FILES = ("tests/data/gsm8k_test.jsonl", "tests/data/math500_test.jsonl",
               "tests/data/aime24_test.jsonl", "tests/data/aime25_test.jsonl",
               "tests/data/amc23_test.jsonl", "tests/data/gsm8k_train_head200.jsonl",
               "tests/data/dapo_math_17k_head200.jsonl")


def final_answer(answer) -> str:
    """A gold answer field as a final answer: GSM8K's solutions end with "#### N"."""
    text = str(answer)
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    return text.strip()


def question_and_answer(row: dict, fields: dict[str, str] | None = None
                        ) -> tuple[str, str] | None:
    """(question, gold final answer) of a row, by ``fields`` ({"question": column,
    "answer": column}) or in any supported schema; None when the row has neither."""
    if fields is not None:
        question, answer = row.get(fields["question"]), row.get(fields["answer"])
        if question in (None, "") or answer in (None, ""):
            return None
        return str(question), final_answer(answer)
    if "question" in row and row.get("answer") not in (None, ""):  # GSM8K, AMC23
        return str(row["question"]), final_answer(row["answer"])
    if "problem" in row and row.get("answer") not in (None, ""):  # MATH-500, DAPO, Big-Math
        return str(row["problem"]), str(row["answer"]).strip()
    if isinstance(row.get("prompt"), list) and isinstance(row.get("reward_model"), dict):
        # DAPO-Math-17k on the hub: the prompt carries its own instruction text.
        content = row["prompt"][-1].get("content", "")
        return str(content), str(row["reward_model"].get("ground_truth", "")).strip()
    return None


def source_id(row: dict, index: int) -> str:
    """A row's own id (AIME's ``id``, MATH-500's ``unique_id``, ...), else its position."""
    return str(next((row[c] for c in ID_COLUMNS if row.get(c) not in (None, "")), index))


def _rows(name: str, path: str | Path | None, split: str):
    import datasets

    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"dataset file {path} does not exist")
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
        if kind is None:
            raise DataError(f"dataset file {path}: expected .jsonl, .json or .parquet")
        try:
            return datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as e:  # datasets raises many types for unreadable files
            raise DataError(f"cannot read dataset file {path}: {e}") from e
    hub = HUB[name]
    try:
        return datasets.load_dataset(hub.repo, hub.config, split=split)
    except Exception as e:  # unreachable hub, offline mode, missing split, ...
        raise DataError(
            f"cannot load {hub.repo} from the Hugging Face Hub ({type(e).__name__}: {e}). "
            f"Offline, give a local copy: `qerl eval --data {name}=FILE` or `data.path` in "
            f"a training config; this repository has {', '.join(LOCAL_FILES)}") from e


def load_task(name: str, path: str | Path | None = None, split: str | None = "train",
              limit: int | None = None, level: int = 1, size: int = 1024, seed: int = 0,
              fields: dict[str, str] | None = None):
    """The task as a datasets.Dataset with columns ``prompt`` (a user message), ``answer``
    and ``source_id`` (the row's own id, else its position); ``limit`` keeps the first
    rows; ``split`` None is the task's evaluation split; ``fields`` maps a local file's
    columns ({"question": ..., "answer": ...})."""
    import datasets

    if name not in TASKS:
        raise DataError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    if fields is not None and set(fields) != {"question", "answer"}:
        raise DataError(f"fields maps 'question' and 'answer' to columns, got {fields}")
    if name == "arithmetic":
        pairs = arithmetic_problems(level, size, seed)
        ids = [str(i) for i in range(len(pairs))]
    else:
        rows = _rows(name, path, split or HUB[name].split)
        if fields is not None and rows.column_names and not set(fields.values()) <= set(
                rows.column_names):
            missing = sorted(set(fields.values()) - set(rows.column_names))
            raise DataError(f"{path or name}: no column(s) {missing}; it has "
                            f"{rows.column_names}")
        usable = [(qa, source_id(r, i)) for i, r in enumerate(rows)
                  if (qa := question_and_answer(r, fields))]
        pairs, ids = [qa for qa, _ in usable], [i for _, i in usable]
    if limit is not None:
        pairs, ids = pairs[:limit], ids[:limit]
    if not pairs:
        raise DataError(f"task {name} ({path or 'hub'}) has no usable rows (each needs a "
                        "question/problem and a final answer)")
    return datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"{q}\n{INSTRUCTION}"}] for q, _ in pairs],
        "answer": [a for _, a in pairs],
        "source_id": ids,
    })


def arithmetic_problems(level: int, size: int, seed: int) -> list[tuple[str, str]]:
    """``size`` integer problems whose difficulty grows with ``level`` (1-5): 1, one-digit
    sums; 2, two-digit sums and differences; 3, a product plus a term; 4, three-digit
    mixed expressions with parentheses; 5, four terms with products of two-digit numbers.
    The same (level, size, seed) always gives the same problems."""
    if not 1 <= level <= 5:
        raise DataError(f"arithmetic level must be 1 to 5, got {level}")
    if size < 1:
        raise DataError(f"arithmetic size must be >= 1, got {size}")
    rng = random.Random(f"arithmetic-{level}-{seed}")

    def n(digits: int) -> int:
        return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1)

    def sign() -> int:
        return rng.choice((1, -1))

    def op(s: int) -> str:
        return "+" if s > 0 else "-"

    out = []
    for _ in range(size):
        if level == 1:
            a, b = n(1), n(1)
            expr, value = f"{a} + {b}", a + b
        elif level == 2:
            a, b, s = n(2), n(2), sign()
            expr, value = f"{a} {op(s)} {b}", a + s * b
        elif level == 3:
            a, b, c, s = n(1), n(2), n(2), sign()
            expr, value = f"{a} * {b} {op(s)} {c}", a * b + s * c
        elif level == 4:
            a, b, c, d, s = n(3), n(2), n(1), n(3), sign()
            expr, value = f"({a} {op(s)} {b}) * {c} - {d}", (a + s * b) * c - d
        else:
            a, b, c, d, e, s = n(2), n(2), n(2), n(2), n(3), sign()
            expr, value = f"{a} * {b} {op(s)} {c} * {d} - {e}", a * b + s * c * d - e
        out.append((f"What is {expr}?", str(value)))
    return out
