"""The expected values of the gpu and rehearsal configurations (workflows/expected/): what
workflows/scripts/make_expected.py makes of our committed runs, passed by those runs, failed
by a number nudged past its tolerance (the key named), and on a card model without a file of
its own, checked where they can be, saying what was not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest

from qerl.report.check import JobTimes, check
from qerl.report.expected import read_expected

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = ROOT / "workflows" / "expected"
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module")
def make():
    spec = importlib.util.spec_from_file_location(
        "make_expected", ROOT / "workflows" / "scripts" / "make_expected.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def evidence(make):
    return make.evidence()


@pytest.mark.parametrize("name", ["gpu", "rehearsal"])
def test_the_expected_files_are_what_our_committed_runs_make(make, evidence, name):
    """Rerun workflows/scripts/make_expected.py after committing a new run."""
    for path, text in make.files(name, evidence).items():
        assert path.read_text() == text, f"{path.name} is not current"


@pytest.mark.parametrize("name", ["gpu", "rehearsal"])
def test_our_committed_runs_pass_their_own_check(evidence, name):
    found = evidence.runs[name]
    verdict = check(found.values, EXPECTED / f"{name}.csv",
                    JobTimes.read(ROOT / "results" / name))
    assert verdict.passed, verdict.message()
    assert verdict.files == [EXPECTED / f"{name}.csv", EXPECTED / f"{name}-h200.csv"]
    assert not verdict.unchecked  # every job ran in the recorded run


def _nudged(values: pd.DataFrame, key: str, by: float) -> pd.DataFrame:
    return values.assign(value=values.value.where(values.key != key, values.value + by))


@pytest.mark.parametrize("bound", ["band", "floor", "ceiling"])
def test_a_number_nudged_past_its_tolerance_fails_the_check_naming_it(evidence, bound):
    """The first row of each bound in gpu's files, moved half its tolerance past it the way
    the bound forbids (a band: either way), and moved as far the way it allows."""
    found = evidence.runs["gpu"]
    rows = pd.concat([read_expected(EXPECTED / f).rows for f in ("gpu.csv", "gpu-h200.csv")])
    row = rows[(rows.bound == bound) & ~rows.key.str.contains("{card}|/step\\d+-|^job/")]
    row = row.iloc[0]
    ours = found.values.set_index("key").value[row.key]
    past = 1.5 * row.tolerance
    jobs = JobTimes.read(ROOT / "results" / "gpu")
    direction = -1 if bound == "floor" else 1
    verdict = check(_nudged(found.values, row.key, direction * past + (row.value - ours)),
                    EXPECTED / "gpu.csv", jobs)
    assert [line.split(":")[0] for line in verdict.drifted] == [row.key]
    allowed = -direction * past if bound != "band" else 0.5 * row.tolerance
    assert check(_nudged(found.values, row.key, allowed), EXPECTED / "gpu.csv", jobs).passed


def test_a_training_window_and_a_job_time_past_their_tolerances_are_named(evidence):
    found = evidence.runs["gpu"]
    rows = read_expected(EXPECTED / "gpu.csv").rows.set_index("key")
    window = "train/smollm2-135m-instruct/arithmetic/qerl/step38-50/reward"
    # The window's mean moves by a thirteenth of what its last step moves.
    step50 = "train/smollm2-135m-instruct/arithmetic/qerl/step50/reward"
    moved = _nudged(found.values, step50, -13 * 1.5 * rows.tolerance[window])
    jobs = JobTimes.read(ROOT / "results" / "gpu")
    assert [line.split(":")[0] for line in check(moved, EXPECTED / "gpu.csv", jobs).drifted] \
        == [window]
    job = "train/smollm2-135m-instruct/arithmetic/qerl"
    slow = JobTimes({**jobs.seconds, job: 3.5 * jobs.seconds[job]}, jobs.card)
    assert check(found.values, EXPECTED / "gpu.csv", slow).drifted == [
        f"job/{job}: {3.5 * jobs.seconds[job]} (expected at most "
        f"{3 * jobs.seconds[job]:.6g}: {jobs.seconds[job]} + {2 * jobs.seconds[job]:g})"]


def test_on_a_card_with_no_expected_file_what_any_card_should_reproduce_is_checked(evidence):
    """gpu's run as if on an H100 (no gpu-h100-80gb-hbm3.csv): gpu.csv is checked (its
    {card} rows on the H100's keys), and the speeds and job times the H200's file checks
    are named as not checked, by kind."""
    found = evidence.runs["gpu"]
    values = found.values.copy()
    measured = (values.recipe == values.card) & (values.card == H200)
    values.loc[measured, "key"] = values.key[measured].str.replace(H200, H100, regex=False)
    values.loc[measured, "recipe"] = H100
    values.loc[values.card == H200, "card"] = H100
    jobs = JobTimes.read(ROOT / "results" / "gpu")
    verdict = check(values, EXPECTED / "gpu.csv", JobTimes(jobs.seconds, H100))
    assert verdict.passed and verdict.files == [EXPECTED / "gpu.csv"]
    anywhere = read_expected(EXPECTED / "gpu.csv").rows
    assert verdict.checked == len(anywhere)  # each {card} row found on one card: the H100
    on_h100 = values[values.card == H100]
    speeds = {("kernels", "speedup_vs_bf16"), ("rollout", "tok_per_s"),
              ("step", "speed_vs_lora"), ("decode_step", "step_ms")}
    counts = {kind: sum((k, m) in speeds for k, m in zip(on_h100.kind, on_h100.metric,
                                                         strict=True) if k == kind)
              for kind in sorted({k for k, _ in speeds})}
    listed = ", ".join([f"decode_step {counts['decode_step']}",
                        f"job times {len(jobs.seconds)}", f"kernels {counts['kernels']}",
                        f"rollout {counts['rollout']}", f"step {counts['step']}"])
    total = sum(counts.values()) + len(jobs.seconds)
    assert verdict.unchecked == [
        f"{total} values measured on {H100} ({listed}), which {EXPECTED / 'gpu-h200.csv'} "
        f"check on another card: there is no {EXPECTED / 'gpu-h100-80gb-hbm3.csv'}"]
