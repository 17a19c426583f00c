"""qerl report: values gathered from a results tree as the workflow writes it, tables with
the paper's numbers beside ours, figures, and --check."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from qerl.cli import main
from qerl.report.check import DriftError, drifts
from qerl.report.run import report

CARD = "NVIDIA H100 80GB HBM3"


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(path, index=False)


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "results"
    write(root / "eval/qwen2.5-7b-instruct/gsm8k/qerl/summary.csv",
          [{"bench": "gsm8k", "problems": 1319, "samples": 1, "avg@1": 0.9, "pass@1": 0.9},
           {"bench": "math500", "problems": 500, "samples": 1, "avg@1": 0.75, "pass@1": 0.75}])
    write(root / "eval/qwen2.5-7b-instruct/base/bf16/summary.csv",
          [{"bench": "gsm8k", "problems": 1319, "samples": 1, "avg@1": 0.8, "pass@1": 0.8}])
    write(root / "eval/qwen2.5-7b-instruct/base/external/summary.csv",
          [{"tool": "lm-eval", "bench": "gsm8k", "metric": "exact_match,strict-match",
            "value": 0.85}])
    write(root / "train/tiny/smoke/qerl/metrics.csv",
          [{"step": 1, "loss": 0.5, "reward": 0.1, "entropy": 2.0, "aqn/sigma": 0.0},
           {"step": 2, "loss": 0.4, "reward": 0.3, "entropy": 1.9, "aqn/sigma": 0.01}])
    write(root / "train/tiny/smoke/lora/metrics.csv",
          [{"step": 1, "loss": 0.6, "reward": 0.1, "entropy": 1.5},
           {"step": 2, "loss": 0.5, "reward": 0.2, "entropy": 1.4}])
    rollout = [{"card": CARD, "model": "qwen2.5-14b", "weights": w, "lora_rank": r,
                "batch": 32, "prompt_len": 256, "tok_per_s": t}
               for w, r, t in [("bf16", 16, 1000.0), ("nvfp4", 16, 1500.0),
                               ("bf16", 32, 900.0), ("nvfp4", 32, 1200.0)]]
    write(root / f"bench/rollout/rollout_{CARD.replace(' ', '_')}.csv", rollout)
    step = [{"date": d, "card": CARD, "model": "qwen2.5-7b", "method": m, "lora_rank": 32,
             "generations": 8, "completion": 512, "prompts": 4, "micro_batch": 8,
             "grad_ckpt": 0, "step_s": t, "rollout_s": t - 2, "train_s": 1.5,
             "peak_gb": 40.0}
            for d, m, t in [("2026-01-01 10:00", "qlora", 9.0), ("2026-01-02 10:00", "lora", 8.0),
                            ("2026-01-02 10:20", "qerl", 6.4)]]
    write(root / f"bench/step/efficiency_{CARD.replace(' ', '_')}.csv", step)
    for variant, gain in (("lora", 0.1), ("qerl", 0.2)):
        for seed in (0, 1):
            run = root / f"science/smol/{variant}/seed{seed}"
            write(run / "metrics.csv", [{"step": k, "reward": gain * k + seed / 10,
                                         "entropy": 1.0 - 0.1 * k} for k in (1, 2, 3, 4)])
            write(run / "eval/summary.csv", [{"bench": "gsm8k", "avg@4": gain + seed / 10}])
    write(root / "science/smol/entropy/entropy_cpu.csv",
          [{"card": "cpu", "weights": w, "own_entropy": e, "shared_entropy": e - 0.1}
           for w, e in (("bf16", 1.5), ("nvfp4", 1.9))])
    return root


def test_tables_put_the_papers_numbers_beside_ours(results):
    written = report(results)
    assert set(written["tables"]) == {"accuracy", "rollout", "training", "efficiency",
                                      "science"}
    study = pd.read_csv(results / "tables/science.csv").set_index("variant")
    assert study.loc["qerl", "seeds"] == 2 and study.loc["qerl", "steps"] == 4
    assert study.loc["qerl", "reward (last quarter) mean"] == pytest.approx(0.85)
    assert study.loc["qerl", "reward (last quarter) std"] == pytest.approx(0.1 / 2**0.5)
    assert study.loc["qerl", "reward growth mean"] == pytest.approx(0.6)  # step 4 - step 1
    assert study.loc["lora", "reward growth mean"] == pytest.approx(0.3)
    assert study.loc["lora", "gsm8k avg@4 mean"] == pytest.approx(0.15)
    assert study.loc["lora", "gsm8k avg@4 seeds"] == 2
    assert "science_smol.png" in written["figures"]
    efficiency = pd.read_csv(results / "tables/efficiency.csv").set_index("method")
    assert efficiency.loc["qerl", "speed vs lora"] == pytest.approx(1.25)
    assert pd.isna(efficiency.loc["qlora", "speed vs lora"])  # a day apart: another run
    assert efficiency.loc["qerl", "paper speed vs lora"] == 1.2
    accuracy = pd.read_csv(results / "tables/accuracy.csv")
    row = accuracy[(accuracy.recipe == "gsm8k") & (accuracy.bench == "gsm8k")].iloc[0]
    assert (row.reproduced, row.paper) == (pytest.approx(90.0), 90.8)
    assert row.delta == pytest.approx(-0.8)
    base = accuracy[accuracy.recipe == "base"].iloc[0]
    assert base.reproduced == pytest.approx(80.0) and pd.isna(base.paper)
    rollout = pd.read_csv(results / "tables/rollout.csv").set_index("rank-batch-prompt")
    assert rollout.loc["r16-b32-p256", "nvfp4/bf16"] == pytest.approx(1.5)
    assert rollout.loc["r16-b32-p256", "paper qerl/lora"] == pytest.approx(95.3 / 65.4)
    assert rollout.loc["r32-b32-p256", "paper qerl/lora"] == pytest.approx(92.9 / 63.1)
    training = pd.read_csv(results / "tables/training.csv").set_index("method")
    assert training.loc["qerl", "reward (last)"] == pytest.approx(0.3)
    assert training.loc["lora", "steps"] == 2
    assert (results / "tables/accuracy.md").read_text().startswith("| model")
    assert {"curves_tiny_smoke.png", "rollout_by_rank.png"} <= set(written["figures"])
    assert all((results / "figures" / f).stat().st_size > 1000 for f in written["figures"])


def test_every_number_has_a_stable_key(results):
    report(results)
    values = pd.read_csv(results / "tables/values.csv").set_index("key").value
    assert values["eval/qwen2.5-7b-instruct/gsm8k/qerl/math500/pass@1"] == 0.75
    assert values["external/qwen2.5-7b-instruct/base/lm-eval/gsm8k/exact_match,strict-match"] \
        == 0.85
    assert values["train/tiny/smoke/qerl/step2/aqn/sigma"] == 0.01
    assert values[f"rollout/qwen2.5-14b/{CARD}/nvfp4/r32-b32-p256/tok_per_s"] == 1200.0
    assert values["science/smol/qerl/seed1/step4/reward"] == pytest.approx(0.9)
    assert values["entropy/smol/cpu/nvfp4/own/entropy"] == 1.9


def test_check_names_each_drift_and_each_missing_value(results, tmp_path):
    expected = tmp_path / "expected.csv"
    expected.write_text("# comment lines are allowed\nkey,value,tolerance\n"
                        "train/tiny/smoke/qerl/step2/reward,0.3,0.001\n"
                        "train/tiny/smoke/lora/step2/entropy,1.0,0.1\n"
                        "eval/tiny/smoke/qerl/gsm8k/pass@1,0.5,0.0\n")
    with pytest.raises(DriftError) as err:
        report(results, expected=expected)
    message = str(err.value)
    assert "2 value(s) drifted" in message
    assert "train/tiny/smoke/lora/step2/entropy: 1.4 (expected 1.0 +- 0.1)" in message
    assert "eval/tiny/smoke/qerl/gsm8k/pass@1: missing" in message
    assert "step2/reward" not in message
    assert main(["report", "--results", str(results), "--check", str(expected)]) == 2


def test_a_value_that_is_not_a_number_is_a_drift():
    values = pd.DataFrame({"key": ["a"], "value": [float("nan")]})
    assert drifts(values, pd.DataFrame({"key": ["a"], "value": [1.0], "tolerance": [1.0]}))


def test_bad_expected_files_are_refused(results, tmp_path):
    with pytest.raises(DriftError, match="no expected values"):
        report(results, expected=tmp_path / "none.csv")
    (tmp_path / "cols.csv").write_text("key,value\na,1\n")
    with pytest.raises(DriftError, match=r"missing \['tolerance'\]"):
        report(results, expected=tmp_path / "cols.csv")


def test_an_empty_results_folder_gives_no_tables(tmp_path):
    written = report(tmp_path)
    assert written["tables"] == [] and written["figures"] == []
    assert pd.read_csv(tmp_path / "tables/values.csv").empty
