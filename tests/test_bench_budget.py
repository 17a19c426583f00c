"""`qerl bench budget` (qerl.bench.capped_step) on the CPU: its options checked, each (model,
method)'s rows composed from its measurements, the driver's peak sampled (NVML stood in
for), a step under a budget through `qerl bench step --memory-gb`, and fits.md drawn from
rows written as the benchmark writes them. Its measurement itself needs a GPU and NVML."""

from __future__ import annotations

import sys
import time
import types

import pandas as pd
import pytest

from qerl.bench import capped_step
from qerl.bench.driver_memory import DriverPeak
from qerl.cli import main
from qerl.report.collect import collect
from qerl.report.tables import TABLES

pytestmark = pytest.mark.usefixtures("reference_kernels")


@pytest.mark.parametrize(("options", "words"), [
    (["--memory-gb", "8,lots"], "--memory-gb takes budgets in GB"),
    (["--memory-gb", "8,0"], "a budget must be positive"),
    (["--methods", "qerl,full"], "a budget plans qerl, lora, qlora; not full")])
def test_bad_options_are_refused_by_name(capsys, options, words):
    with pytest.raises(SystemExit):
        capped_step.parse(options)
    assert words in capsys.readouterr().err


def test_a_budget_that_cannot_fit_is_a_refusal_with_the_smallest_budget():
    args = capped_step.parse(["--memory-gb", "7"])
    refused = capped_step.planned(args, "qwen2.5-7b", "qerl", 7.0)
    assert isinstance(refused, Exception) and "does not fit memory_gb 7" in str(refused)
    plan = capped_step.planned(args, "qwen2.5-7b", "qerl", refused.needs_gb)
    assert plan.micro_batch == 1
    assert plan.measures == ("offload.embedding", "engine.release_cache", "offload.optimizer",
                             "offload.activations")


def test_a_pairs_rows_carry_their_verdict_and_time_against_the_whole_card():
    measured = [(79.6, {"status": "ok", "step_s": 40.0, "nvml_peak_gb": 30.0}),
                (16.0, {"status": "ok", "step_s": 50.0, "nvml_peak_gb": 15.5,
                        "micro_batch": 4, "rollout_batch": 8, "needs_gb": 12.6}),
                (12.0, {"status": "ok", "step_s": 60.0, "nvml_peak_gb": 12.4}),
                (10.0, {"status": "oom", "error": "CUDA out of memory"}),
                (8.0, {"status": "refused", "needs_gb": 9.13})]
    rows = capped_step.pair_rows({"model": "qwen2.5-7b"}, 79.6, measured)
    assert [r["status"] for r in rows] == ["ok", "ok", "over", "oom", "refused"]
    assert [r["whole_card"] for r in rows] == [1, 0, 0, 0, 0]
    assert [r["time_vs_uncapped"] for r in rows] == [1.0, 1.25, 1.5, None, None]
    assert {r["uncapped_step_s"] for r in rows} == {40.0}
    assert (rows[1]["micro_batch"], rows[4]["needs_gb"]) == (4, 9.13)
    failed = capped_step.pair_rows({}, 79.6, [(79.6, {"status": "failed"}),
                                              (8.0, {"status": "ok", "step_s": 1.0})])
    assert [r["time_vs_uncapped"] for r in failed] == [None, None]


def test_the_whole_card_runs_only_where_some_budget_fits():
    # 32B in BF16 is ~65 GB of weights: LoRA cannot fit 32 GB, QeRL's 4-bit base can.
    args = capped_step.parse(["--memory-gb", "32"])
    assert capped_step.budgets_to_run(args, "qwen2.5-32b", "lora", 79.6) == [32.0]
    assert capped_step.budgets_to_run(args, "qwen2.5-32b", "qerl", 79.6) == [79.6, 32.0]


def test_whole_card_only_or_earlier_splits_the_comparison_over_two_runs(tmp_path):
    """A step too long for one call: the whole card's alone, then the budgets' compared
    with the newest whole-card step of the same card, model, method and settings."""
    only = capped_step.parse(["--memory-gb", "32", "--whole-card", "only"])
    earlier = capped_step.parse(["--memory-gb", "32", "--whole-card", "earlier"])
    assert capped_step.budgets_to_run(only, "qwen2.5-32b", "qerl", 79.6) == [79.6]
    assert capped_step.budgets_to_run(earlier, "qwen2.5-32b", "qerl", 79.6) == [32.0]
    settings = {"card": "H100", "model": "qwen2.5-32b", "method": "qerl", "lora_rank": 32,
                "prompts": 1, "generations": 8, "completion": 2048, "prompt_tokens": 64,
                "kernel_arch": "sm_89", "kv_cache": "bf16"}
    path = tmp_path / "budget_H100.csv"
    pd.DataFrame([
        {**settings, "run": "old", "whole_card": 1, "status": "ok", "step_s": 70.0},
        {**settings, "run": "new", "whole_card": 1, "status": "ok", "step_s": 80.0},
        {**settings, "run": "failed", "whole_card": 1, "status": "oom", "step_s": None},
        {**settings, "run": "other", "completion": 512, "whole_card": 1, "status": "ok",
         "step_s": 20.0},
        {**settings, "run": "capped", "whole_card": 0, "status": "ok", "step_s": 90.0},
    ]).to_csv(path, index=False)
    found = capped_step.earlier_whole_card(path, settings)
    assert (found["run"], found["step_s"]) == ("new", 80.0)
    assert capped_step.earlier_whole_card(path, {**settings, "kernel_arch": "sm_80"}) is None
    assert capped_step.earlier_whole_card(tmp_path / "none.csv", settings) is None
    rows = capped_step.pair_rows({"run": "this"}, 79.6, [(32.0, {"status": "ok",
                                                                 "step_s": 100.0})], found)
    assert (rows[0]["time_vs_uncapped"], rows[0]["uncapped_run"]) == (1.25, "new")
    alone = capped_step.pair_rows({"run": "this"}, 79.6, [(32.0, {"status": "ok",
                                                                  "step_s": 100.0})])
    assert (alone[0]["time_vs_uncapped"], alone[0]["uncapped_run"]) == (None, None)


def test_the_driver_peak_is_the_most_in_use_above_the_start(monkeypatch):
    """NVML stood in for: 3 GB in use before, then 5, 9 and 4 GB: the peak is 6 GB."""
    readings = iter([3e9, 5e9, 9e9, *[4e9] * 10_000])
    calls = []
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByUUID=lambda uuid: calls.append(uuid) or "handle",
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(used=next(readings)))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with DriverPeak("GPU-1234", every_s=0.001) as driver:
        time.sleep(0.05)
    assert driver.peak_gb == pytest.approx(6.0) and calls == ["init", "GPU-1234", "shutdown"]


def test_qerl_bench_step_under_a_budget_records_the_plans_settings(tmp_path):
    """On the CPU the plan is applied, not enforced: the row holds the budget and the
    settings its plan chose in place of the options' (a micro-batch of at most 2)."""
    from qerl.archs import config_for
    from qerl.rl.budget import DoesNotFit, plan_step

    step = {"method": "qerl", "completions": 2, "max_micro_batch": 2, "prompt_len": 64,
            "completion": 4, "rank": 4}
    with pytest.raises(DoesNotFit) as smallest:
        plan_step(config_for("tiny-llama"), budget_gb=1.0, **step)
    budget_gb = smallest.value.needs_gb
    plan = plan_step(config_for("tiny-llama"), budget_gb=budget_gb, **step)
    main(["bench", "step", "--archs", "tiny-llama", "--methods", "qerl", "--prompts", "1",
          "--generations", "2", "--completion", "4", "--micro-batch", "2", "--steps", "1",
          "--rank", "4", "--prompt-tokens", "64", "--device", "cpu",
          "--memory-gb", str(budget_gb), "--out-dir", str(tmp_path)])
    row = pd.read_csv(next(tmp_path.glob("efficiency_*.csv"))).iloc[0]
    assert row.status == "ok" and row.memory_gb == budget_gb
    assert (row.micro_batch, row.rollout_batch, row.grad_ckpt) == (
        plan.micro_batch, plan.rollout_batch, 1)


def test_fits_shows_each_models_verdict_per_budget(tmp_path):
    common = {"date": "2026-12-10 10:00", "card": "NVIDIA H100 80GB HBM3", "run": "r1",
              "lora_rank": 32, "prompts": 1, "generations": 8, "completion": 2048,
              "prompt_tokens": 64, "kernel_arch": "sm_89"}
    rows = [
        {"model": "qwen2.5-14b", "method": "qerl", "memory_gb": 79.6, "whole_card": 1,
         "status": "ok", "step_s": 40.0, "time_vs_uncapped": 1.0},
        {"model": "qwen2.5-14b", "method": "qerl", "memory_gb": 16, "whole_card": 0,
         "status": "ok", "step_s": 52.0, "time_vs_uncapped": 1.3,
         "measures": "offload.embedding+engine.release_cache"},
        {"model": "qwen2.5-14b", "method": "qerl", "memory_gb": 8, "whole_card": 0,
         "status": "refused", "needs_gb": 15.61},
        {"model": "qwen2.5-7b", "method": "qerl", "memory_gb": 8, "whole_card": 0,
         "status": "over", "nvml_peak_gb": 8.42},
        {"model": "qwen2.5-7b", "method": "lora", "memory_gb": 16, "whole_card": 0,
         "status": "oom"}]
    path = tmp_path / "bench" / "budget_NVIDIA_H100_80GB_HBM3.csv"
    path.parent.mkdir()
    pd.DataFrame([{**common, **r} for r in rows]).to_csv(path, index=False)
    table = TABLES["fits"](collect(tmp_path).frames)
    assert list(table.columns) == ["card", "kernel_arch", "step", "model", "method", "8 GB",
                                   "16 GB"]
    cells = {(r.model, r.method): (r["8 GB"], r["16 GB"]) for _, r in table.iterrows()}
    assert cells == {("qwen2.5-7b", "lora"): ("", "oom"),  # "": not measured
                     ("qwen2.5-7b", "qerl"): ("over: 8.42 GB", ""),
                     ("qwen2.5-14b", "qerl"): ("needs 15.61 GB", "1.30x (offload.embedding, "
                                                                   "engine.release_cache)")}
    assert list(table.model) == ["qwen2.5-7b", "qwen2.5-7b", "qwen2.5-14b"]
    assert set(table.step) == {"1x8x2048 r32"}


def test_fits_names_an_fp8_kv_cache_in_the_step(tmp_path):
    """The same model at the same budget with another KV cache is another step: a row of
    its own, the format named (bf16, and rows from before the option, unnamed)."""
    common = {"date": "2026-12-10 10:00", "card": "NVIDIA H100 80GB HBM3", "run": "r1",
              "lora_rank": 32, "prompts": 1, "generations": 8, "completion": 2048,
              "prompt_tokens": 64, "kernel_arch": "sm_89", "model": "qwen2.5-7b",
              "method": "qerl", "memory_gb": 8, "whole_card": 0}
    rows = [{**common, "kv_cache": "fp8", "status": "ok", "time_vs_uncapped": 1.1},
            {**common, "kv_cache": "bf16", "status": "oom"},
            {**common, "kv_cache": None, "status": "refused", "needs_gb": 8.2, "run": "r0"}]
    path = tmp_path / "bench" / "budget_NVIDIA_H100_80GB_HBM3.csv"
    path.parent.mkdir()
    pd.DataFrame(rows).to_csv(path, index=False)
    table = TABLES["fits"](collect(tmp_path).frames)
    cells = dict(zip(table.step, table["8 GB"], strict=True))
    assert cells["1x8x2048 r32 fp8 KV cache"] == "1.10x"
    assert cells["1x8x2048 r32"] in ("oom", "needs 8.20 GB")


def test_kv_cache_fp8_reaches_the_plan_and_the_trained_configuration(tmp_path):
    from qerl.bench.step import run_config
    from qerl.config import parse_config

    args = capped_step.parse(["--memory-gb", "56", "--kv-cache", "fp8"])
    assert capped_step.planned(args, "qwen2.5-72b", "qerl", 56.0).rollout_batch == 8
    args.memory_gb = 56.0
    config = parse_config(run_config(args, "qwen2.5-72b", "qerl", tmp_path))
    assert config.engine.kv_cache == "fp8"
    with pytest.raises(SystemExit):
        capped_step.parse(["--kv-cache", "int4"])
