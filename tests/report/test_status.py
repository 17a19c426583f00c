"""The README's first table (`status`): each headline claim on each card, split into the
settings where it holds (at least 1x) and those where it does not."""

from __future__ import annotations

import pandas as pd

from qerl.report.collect import collect
from qerl.report.tables import headline, status

CARD = "NVIDIA H100 80GB HBM3"


def frames_with_rollouts(tmp_path, speedups: dict[int, float]) -> dict:
    """The frames `qerl report` reads from a rollout benchmark's rows (one run)."""
    rows = [{"date": "2026-12-01 10:00", "card": CARD, "model": "qwen2.5-7b",
             "weights": weights, "lora_rank": 32, "batch": batch, "group": 1,
             "prompt_len": 256, "gen_len": 1024, "fused": 1,
             "tok_per_s": 100.0 * (speedup if weights == "nvfp4" else 1.0)}
            for batch, speedup in speedups.items() for weights in ("bf16", "nvfp4")]
    (tmp_path / "bench").mkdir()
    pd.DataFrame(rows).to_csv(tmp_path / "bench/rollout_card.csv", index=False)
    return collect(tmp_path).frames


def test_a_claim_is_split_where_it_holds_and_where_it_does_not(tmp_path):
    paper = pd.DataFrame(columns=["model", "metric", "method", "lora_rank", "value", "band",
                                  "trained_on"])
    frames = frames_with_rollouts(tmp_path, {1: 1.9, 16: 1.4, 128: 1.0, 256: 0.95})
    table = status(frames, paper)
    assert len(table) == 1
    row = table.iloc[0]
    assert (row.claim, row.card) == ("rollout tokens/s, NVFP4 / BF16", CARD)
    assert row["holds (>= 1x) at"] == "batch 1, 16, 128"  # level counts as holding
    assert row["does not (< 1x) at"] == "batch 256"
    assert row["range"] == "0.95-1.90x" and row.table == "rollout.md"
    # Every headline line of the claim is in one of the two columns, no other.
    lines = headline(frames, paper)
    assert len(lines) == 4 and set(lines.card) == {CARD}
