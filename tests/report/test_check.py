"""`qerl report --check` and `--check-paper` on constructed values: what each bound allows,
the keys that name more than one number ({card}, stepA-B), job times, a card model with no
expected file of its own, bad expected files, and the verdict against the paper."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from qerl.cli import main
from qerl.errors import QerlError
from qerl.report.check import JobTimes, check, paper_verdict
from qerl.report.expected import ExpectedError, card_file, read_expected
from qerl.report.run import read_paper, report
from qerl.report.tables import paper_comparisons

H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"


def values(*rows: tuple) -> pd.DataFrame:
    """A values table (collect's columns that the check reads): (key, value, card), the
    key's parts giving kind, recipe and metric; a measurement's recipe is its card."""
    frame = []
    for key, value, card in rows:
        parts = key.split("/")
        frame.append({"key": key, "value": value, "card": card, "kind": parts[0],
                      "recipe": parts[2], "metric": parts[-1]})
    return pd.DataFrame(frame)


def expected(path: Path, *rows: str, note: str = "") -> Path:
    path.write_text(f"# why each tolerance\n{note}key,value,tolerance,bound\n"
                    + "".join(f"{row}\n" for row in rows))
    return path


STEP = f"step/qwen2.5-7b/{H200}/qerl/lora_rank=32/speed_vs_lora"


def test_each_bound_allows_only_its_side(tmp_path):
    file = expected(tmp_path / "cfg.csv", "eval/m/r/qerl/gsm8k/pass@1,0.5,0.1,band",
                    f"{STEP},1.2,0.2,floor",
                    f"memory/m/{H200}/qerl/lora_rank=16/weights_gb,6.0,0.6,")
    file.write_text(file.read_text().replace(",0.6,\n", ",0.6,ceiling\n"))

    def verdict(accuracy, speed, memory):
        return check(values(("eval/m/r/qerl/gsm8k/pass@1", accuracy, H200),
                            (STEP, speed, H200),
                            (f"memory/m/{H200}/qerl/lora_rank=16/weights_gb", memory, H200)),
                     file, None)

    assert verdict(0.45, 1.0, 6.5).passed  # each inside: 0.5 +- 0.1, >= 1.0, <= 6.6
    assert verdict(0.6, 9.0, 1.0).passed  # the open sides are open
    failed = verdict(0.39, 0.99, 6.61)
    assert not failed.passed and len(failed.drifted) == 3
    assert failed.drifted[0] == "eval/m/r/qerl/gsm8k/pass@1: 0.39 (expected 0.5 +- 0.1)"
    assert failed.drifted[1].startswith(f"{STEP}: 0.99 (expected at least 1: 1.2 - 0.2)")
    assert "weights_gb: 6.61 (expected at most 6.6: 6.0 + 0.6)" in failed.drifted[2]
    assert failed.message().startswith(f"3 value(s) drifted from {file}:\n  eval/m/r/")
    # Not a number is never within a tolerance; a value not there at all is named missing.
    nan = verdict(float("nan"), 1.0, 6.0)
    assert nan.drifted == ["eval/m/r/qerl/gsm8k/pass@1: nan (expected 0.5 +- 0.1)"]
    gone = check(values((STEP, 1.2, H200)), file, None)
    assert "eval/m/r/qerl/gsm8k/pass@1: missing (expected 0.5)" in gone.drifted


def test_a_card_placeholder_and_a_step_range_name_numbers_a_key_cannot(tmp_path):
    file = expected(tmp_path / "cfg.csv",
                    "memory/m/{card}/qerl/lora_rank=16/weights_gb,6.0,0.6,ceiling",
                    "train/m/r/qerl/step2-4/reward,0.5,0.05,band")
    steps = [(f"train/m/r/qerl/step{n}/reward", r, H200)
             for n, r in ((1, 9.0), (2, 0.4), (3, 0.5), (4, 0.7))]  # steps 2-4: mean 0.5333
    both_cards = [(f"memory/m/{card}/qerl/lora_rank=16/weights_gb", gb, card)
                  for card, gb in ((H200, 6.0), (H100, 7.0))]
    verdict = check(values(*steps, *both_cards), file, None)
    assert verdict.checked == 3  # the memory on each card, and the window's mean
    assert verdict.drifted == [f"memory/m/{H100}/qerl/lora_rank=16/weights_gb: 7.0 "
                               "(expected at most 6.6: 6.0 + 0.6)"]
    moved = [(k, 0.6 if k.endswith("step4/reward") else v, c) for k, v, c in steps]
    assert check(values(*moved, both_cards[0]), file, None).passed  # mean 0.5
    moved = [(k, 0.3 if k.endswith("step4/reward") else v, c) for k, v, c in steps]
    assert check(values(*moved, both_cards[0]), file, None).drifted == [
        f"train/m/r/qerl/step2-4/reward: {(0.4 + 0.5 + 0.3) / 3} (expected 0.5 +- 0.05)"]
    no_step3 = [row for row in steps if "step3" not in row[0]]
    assert check(values(*no_step3, both_cards[0]), file, None).drifted == [
        "train/m/r/qerl/step2-4/reward: missing (expected 0.5)"]


def test_job_times_come_from_the_run_record_and_say_when_they_cannot(tmp_path):
    file = expected(tmp_path / "cfg.csv", "eval/m/r/qerl/gsm8k/pass@1,0.5,0.1,band")
    expected(card_file(file, H200), f"{STEP},1.2,0.2,floor",
             "job/train/m/r/qerl,100,200,ceiling", "job/bench/kernels,30,60,ceiling")
    measured = values(("eval/m/r/qerl/gsm8k/pass@1", 0.5, H200), (STEP, 1.2, H200))
    slow = check(measured, file, JobTimes({"train/m/r/qerl": 301.0}, H200))
    assert slow.drifted == ["job/train/m/r/qerl: 301.0 (expected at most 300: 100.0 + 200.0)"]
    assert slow.files == [file, tmp_path / "cfg-h200.csv"] and slow.checked == 3
    assert slow.unchecked == ["1 job times of jobs this run did not run (their results "
                              "were kept from before)"]
    unrecorded = check(measured, file, None)
    assert unrecorded.passed and unrecorded.checked == 2
    assert unrecorded.unchecked == ["2 job times (no run record beside the results: run.json)"]
    mixed = check(measured, file, JobTimes({"train/m/r/qerl": 1.0}, None))
    assert mixed.unchecked == ["2 job times (the run held several card models: run.json)"]
    # The record as the workflow writes it: "N x NAME" for each card model.
    (tmp_path / "run.json").write_text(json.dumps(
        {"card": f"1 x {H200}", "jobs_s": {"train/m/r/qerl": 120.5}}))
    assert JobTimes.read(tmp_path) == JobTimes({"train/m/r/qerl": 120.5}, H200)
    assert JobTimes.card_of(f"2 x {H100}, 1 x {H200}") is None
    assert JobTimes.card_of("cpu") == "cpu"
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(QerlError, match="not a run record"):
        JobTimes.read(tmp_path)


def test_a_card_with_no_expected_file_is_checked_where_it_can_be_and_says_so(tmp_path):
    file = expected(tmp_path / "cfg.csv", "eval/m/r/qerl/gsm8k/pass@1,0.5,0.1,band",
                    "memory/m/{card}/qerl/lora_rank=16/weights_gb,6.0,0.6,ceiling")
    expected(card_file(file, H200), f"{STEP},1.2,0.2,floor", "job/report,5,10,ceiling")
    on_h100 = values(("eval/m/r/qerl/gsm8k/pass@1", 0.55, H100),
                     (f"memory/m/{H100}/qerl/lora_rank=16/weights_gb", 6.1, H100),
                     (STEP.replace(H200, H100), 0.1, H100),  # would fail on an H200
                     (f"step/qwen2.5-7b/{H100}/qerl/lora_rank=32/step_s", 9.0, H100))
    verdict = check(on_h100, file, JobTimes({"report": 50.0, "train/m/r/qerl": 9.0}, H100))
    assert verdict.passed and verdict.checked == 2 and verdict.files == [file]
    # What the H200 file checks (the step's speed, job times) on the H100, step_s not.
    assert verdict.unchecked == [
        f"3 values measured on {H100} (job times 2, step 1), which {card_file(file, H200)} "
        f"check on another card: there is no {tmp_path / 'cfg-h100-80gb-hbm3.csv'}"]
    assert verdict.message() == (
        f"every checked value is within its tolerance of {file} (2 values); not checked: "
        + verdict.unchecked[0])
    assert card_file(file, "cpu").name == "cfg-cpu.csv"


@pytest.mark.parametrize("text, why", [
    ("key,value\na,1\n", r"missing \['tolerance'\]"),
    ("key,value,tolerance,bound,extra\na,1,1,band,x\n", r"unknown columns \['extra'\]"),
    ("key,value,tolerance,bound\na,1,1,above\n", "an unknown bound"),
    ("key,value,tolerance\na,1,-1\n", r"a negative tolerance: \['a'\]"),
    ("key,value,tolerance\na,1,1\na,2,1\n", r"a key given twice: \['a', 'a'\]"),
    ("key,value,tolerance\na,one,1\n", r"value is not a number for \['a'\]"),
])
def test_bad_expected_files_are_refused_naming_why(tmp_path, text, why):
    (tmp_path / "bad.csv").write_text(text)
    with pytest.raises(ExpectedError, match=why):
        read_expected(tmp_path / "bad.csv")


def test_a_missing_expected_file_is_named(tmp_path):
    with pytest.raises(ExpectedError, match="no expected values at .*none.csv"):
        report(tmp_path, expected=tmp_path / "none.csv")
    assert main(["report", "--results", str(tmp_path), "--check",
                 str(tmp_path / "none.csv")]) == 2


def test_by_hand_the_check_says_its_verdict_and_keeps_the_note(tmp_path, capsys):
    results = tmp_path / "results"
    run = results / "train/tiny/smoke/qerl"
    run.mkdir(parents=True)
    pd.DataFrame({"step": [1, 2], "reward": [0.0, 0.0]}).to_csv(run / "metrics.csv",
                                                                 index=False)
    file = expected(tmp_path / "smoke.csv", "train/tiny/smoke/qerl/step1-2/reward,0,1e-6,band",
                    note="# note: Tiny model:\n# note: zeros expected.\n")
    assert read_expected(file).note == "Tiny model: zeros expected."
    assert main(["report", "--results", str(results), "--check", str(file)]) == 0
    said = capsys.readouterr()
    assert json.loads(said.out)["check"]["passed"] is True
    assert said.err == (f"qerl report: every checked value is within its tolerance of "
                        f"{file} (1 values)\n")
    assert (results / "tables/training.md").read_text().startswith(
        "> Tiny model: zeros expected.\n\n| model")  # the note, then the table


# ---- against the paper ----------------------------------------------------------------------

def test_the_paper_check_counts_what_was_reproduced_and_names_the_rest(tmp_path):
    """A constructed results tree: 7B qerl on GSM8K within the paper's band (90 against
    90.8 +- 2.5), 7B LoRA outside it (80 against 88.1 +- 3), 14B rollout at rank 16 and
    batch 1 within (1.5 against 95.3 / 65.4 = 1.457 +- 0.15) and at batch 32 (another
    setting, not compared), an RL step of qerl at 1.25 against 1.2 +- 0.12 on two cards,
    one outside (0.9)."""
    root = tmp_path / "results"

    def write(path: Path, rows: list[dict]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(path, index=False)

    for method, accuracy in (("qerl", 0.9), ("lora", 0.8)):
        write(root / f"eval/qwen2.5-7b-instruct/gsm8k/{method}/summary.csv",
              [{"card": H100, "bench": "gsm8k", "problems": 1319, "samples": 1,
                "pass@1": accuracy}])
    write(root / "bench/rollout/rollout_x.csv",
          [{"card": H100, "model": "qwen2.5-14b", "weights": w, "lora_rank": 16, "batch": b,
            "prompt_len": 256, "gen_len": 512, "fused": 1, "tok_per_s": t}
           for w, b, t in (("bf16", 1, 100.0), ("nvfp4", 1, 150.0), ("bf16", 32, 1000.0),
                           ("nvfp4", 32, 3000.0))])
    write(root / "bench/step/efficiency_x.csv",
          [{"date": "2026-01-02 10:00", "card": card, "model": "qwen2.5-7b", "method": m,
            "lora_rank": 32, "generations": 8, "completion": 512, "prompts": 4,
            "micro_batch": 8, "grad_ckpt": 0, "step_s": t, "peak_gb": 40.0}
           for card, m, t in ((H100, "lora", 10.0), (H100, "qerl", 8.0), (H200, "lora", 9.0),
                              (H200, "qerl", 10.0))])
    paper = read_paper()
    written = report(root, against_paper=True)
    verdict = written["paper"]
    assert verdict["numbers"] == len(paper)
    assert verdict["reproduced"] == ["Qwen2.5-7B-Instruct gsm8k_accuracy qerl",
                                     "Qwen2.5-14B-Instruct rollout_throughput qerl r16"]
    assert verdict["outside_band"] == [
        "Qwen2.5-7B-Instruct gsm8k_accuracy lora: ours 80 vs 88.1 +- 3 (trained on gsm8k, "
        f"gsm8k, {H100})",
        "Qwen2.5-7B-Instruct end_to_end_speed qerl: ours 0.9 vs 1.2 +- 0.12 (4 prompts x 8 x "
        f"512 tokens, LoRA r32, {H200})"]
    banded = paper.band.notna()
    assert len(verdict["not_compared"]) == (~banded).sum()
    assert len(verdict["not_measured"]) == banded.sum() - 4
    assert "Qwen2.5-14B-Instruct rollout_throughput qlora r16" in verdict["not_measured"]
    assert verdict["message"].startswith("2 of the paper's 33 numbers reproduced")
    table = pd.read_csv(root / "tables/versus_paper.csv")
    rollout = table[(table.metric == "rollout_throughput") & (table.method == "qerl")
                    & (table.lora_rank == 16)].iloc[0]
    assert rollout.paper == pytest.approx(95.3 / 65.4) and rollout.ours == pytest.approx(1.5)
    assert rollout.reproduced == "yes"
    # The table as written gives the verdict the report said.
    assert paper_verdict(table).record() == verdict


def test_with_nothing_measured_every_paper_number_is_named(capsys, tmp_path):
    paper = read_paper()
    verdict = paper_verdict(paper_comparisons({}, paper))
    assert verdict.numbers == len(paper) and not verdict.reproduced and not verdict.outside
    assert len(verdict.not_measured) + len(verdict.not_compared) == len(paper)
    assert main(["report", "--results", str(tmp_path), "--check-paper"]) == 0
    assert capsys.readouterr().err.startswith(
        f"qerl report: 0 of the paper's {len(paper)} numbers reproduced")


def test_the_papers_bands_follow_the_rules_paper_csv_states():
    """Accuracy: two standard errors of the difference of two evaluations of the benchmark
    at the paper's p, rounded up to half a point; speed-ups: a tenth of the paper's; LoRA's
    own numbers and the 7B throughputs (no rank, no batch): no band."""
    paper = read_paper()
    problems = {"gsm8k_accuracy": 1319, "math500_accuracy": 500}
    lora = {(r.model, r.lora_rank): r.value for r in paper.itertuples()
            if r.metric == "rollout_throughput" and r.method == "lora"}
    for r in paper.itertuples():
        if r.metric in problems:
            p = r.value / 100
            points = 100 * 2 * math.sqrt(2 * p * (1 - p) / problems[r.metric])
            assert r.band == math.ceil(2 * points) / 2 and r.trained_on == "gsm8k", r
        elif r.method == "lora" or (r.metric == "rollout_throughput" and pd.isna(r.lora_rank)):
            assert pd.isna(r.band), r
        elif r.metric == "rollout_throughput":
            assert r.band == round(r.value / lora[r.model, r.lora_rank] / 10, 2), r
        else:
            assert r.band == round(r.value / 10, 2), r
