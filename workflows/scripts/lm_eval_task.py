"""Write an lm-eval task ``gsm8k_local``: the stock 5-shot ``gsm8k`` task (prompt, few-shot
examples, strict and flexible matching) reading local jsonl files instead of the hub.

    python workflows/scripts/lm_eval_task.py TRAIN.jsonl TEST.jsonl OUT_DIR
    lm_eval run ... --include_path OUT_DIR --tasks gsm8k_local

Runs with the lm-eval environment's python: the stock task file is found in that install.
"""

import sys
from pathlib import Path

import lm_eval


def main(train: str, test: str, out_dir: str) -> None:
    stock = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    if not stock.is_file():
        raise SystemExit(f"lm-eval {lm_eval.__version__} has no {stock}")
    for path in (train, test):
        if not Path(path).is_file():
            raise SystemExit(f"no such file: {path}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # dataset_name must be cleared: the stock value ("main") is a hub configuration.
    (out / "gsm8k_local.yaml").write_text(
        f"include: {stock}\n"
        "task: gsm8k_local\n"
        "tag: []\n"
        "dataset_path: json\n"
        "dataset_name: null\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    train: {Path(train).resolve()}\n"
        f"    test: {Path(test).resolve()}\n")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
