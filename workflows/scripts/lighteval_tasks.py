"""lighteval 0.13's math tasks as the paper ran them (math_500, aime24, aime25), with two
changes, for ``lighteval ... --custom-tasks workflows/scripts/lighteval_tasks.py``:

- a real cap on generated tokens (QERL_LIGHTEVAL_MAX_TOKENS): lighteval 0.13.0's transformers
  backend uses ``generation_parameters={max_new_tokens: N}`` as the prompt's length (it cuts
  the prompt to N tokens) and takes the generated length from the task's generation_size
  (32768 for math_500);
- local data (QERL_LIGHTEVAL_DATA, optional): a folder with ``<task>/<split>.jsonl`` files,
  e.g. ``math_500/test.jsonl`` (the stock tasks load a hub dataset; ``load_dataset`` on a
  local folder reads the same columns).

The tasks are named ``<stock>_qerl`` (lighteval refuses custom tasks named like built-ins).
Runs in the lighteval environment (workflows/envs/lighteval.txt), not in qerl's.
"""

import dataclasses
import os
from pathlib import Path

from lighteval.tasks.tasks.aime import aime24, aime25
from lighteval.tasks.tasks.math_500 import math_500

DATA = os.environ.get("QERL_LIGHTEVAL_DATA")
MAX_TOKENS = os.environ.get("QERL_LIGHTEVAL_MAX_TOKENS")


def ours(task):
    changes = {"name": f"{task.name}_qerl",
               # 0.13.0 keeps stop_sequence as a tuple and then adds a list to it.
               "stop_sequence": list(task.stop_sequence or [])}
    if MAX_TOKENS:
        changes["generation_size"] = int(MAX_TOKENS)
    if DATA and (Path(DATA) / task.name).is_dir():
        changes.update(hf_repo=str(Path(DATA) / task.name), hf_revision=None)
    return dataclasses.replace(task, **changes)


TASKS_TABLE = [ours(task) for task in (math_500, aime24, aime25)]
