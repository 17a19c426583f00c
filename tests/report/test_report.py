"""qerl report: values gathered from a results tree as the workflow writes it, tables with
the paper's numbers beside ours, figures, and --check."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from qerl.cli import main
from qerl.errors import QerlError
from qerl.report.check import DriftError
from qerl.report.collect import MISMATCH, collect, speed_vs_lora
from qerl.report.run import report

CARD = "NVIDIA H100 80GB HBM3"
RESULTS = Path(__file__).resolve().parents[2] / "results"


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
            (run / "provenance.json").write_text(json.dumps({"card": CARD}))
            (run / "config.yaml").write_text(f"train:\n  learning_rate: {gain / 1000}\n")
    write(root / "science/smol/entropy/entropy_cpu.csv",
          [{"card": "cpu", "weights": w, "own_entropy": e, "shared_entropy": e - 0.1}
           for w, e in (("bf16", 1.5), ("nvfp4", 1.9))])
    return root


def test_the_studys_variants_at_one_learning_rate_are_contrasted(results):
    """A control trained at a method's rate is set against it: the difference of the
    seeds' mean growth and held-out score, with Welch's standard error; variants at other
    rates are not paired."""
    growth = {0: 0.2, 1: 0.5}  # this control's per-seed growth: steps 1 -> 4
    for seed, total in growth.items():
        run = results / f"science/smol/lora-at-qerl-rate/seed{seed}"
        write(run / "metrics.csv", [{"step": k, "reward": total * (k - 1) / 3,
                                     "entropy": 1.0} for k in (1, 2, 3, 4)])
        write(run / "eval/summary.csv", [{"bench": "gsm8k", "avg@4": 0.5 + seed / 10}])
        (run / "provenance.json").write_text(json.dumps({"card": "NVIDIA H200"}))
        (run / "config.yaml").write_text("train:\n  learning_rate: 0.0002\n")
    report(results)
    pairs = pd.read_csv(results / "tables/science_contrasts.csv")
    assert len(pairs) == 1  # lora (1e-4) pairs with neither
    row = pairs.iloc[0]
    assert (row.A, row.B, row["card A"], row["card B"]) == ("lora-at-qerl-rate", "qerl",
                                                            "NVIDIA H200", CARD)
    # qerl's growth is 0.6 in both seeds; this control's 0.35 +- 0.15 (sample std 0.212).
    assert row["reward growth A - B"] == pytest.approx(0.35 - 0.6)
    assert row["reward growth se"] == pytest.approx((0.045 / 2) ** 0.5)
    assert row["gsm8k avg@4 A - B"] == pytest.approx(0.55 - 0.25)
    assert row["gsm8k avg@4 se"] == pytest.approx((0.005 / 2 + 0.005 / 2) ** 0.5)


def test_the_headline_states_each_claim_with_its_setting_and_card(results):
    """The headline takes its numbers from the tables: the paper's 7B rollout setting at
    each batch, each RL step against LoRA's, the largest step that ran, the big layers'
    matmul by rows; nothing from other settings."""
    rollout = [{"card": CARD, "model": "qwen2.5-7b", "weights": w, "lora_rank": r,
                "batch": b, "prompt_len": 256, "gen_len": g, "fused": 1, "tok_per_s": t}
               for w, r, b, g, t in [("bf16", 32, 64, 1024, 1000.0),
                                     ("nvfp4", 32, 64, 1024, 1500.0),
                                     ("vllm-nvfp4", 32, 64, 1024, 1200.0),
                                     ("vllm-bf16", 0, 64, 1024, 2000.0),
                                     ("bf16", 32, 64, 512, 1.0), ("nvfp4", 32, 64, 512, 9.0),
                                     ("bf16", 16, 64, 1024, 1.0), ("nvfp4", 16, 64, 1024, 9.0)]]
    grouped = [{**row, "group": 8, "tok_per_s": row["tok_per_s"] * 2} for row in rollout[:2]]
    write(results / "bench/rollout/rollout_7b.csv", rollout)
    write(results / "bench/rollout/rollout_grouped.csv", grouped)
    write(results / "bench/kernels_x.csv",
          [{"card": CARD, "model": "qwen2.5-7b", "layer": "gate_up", "op": "fwd", "M": m,
            "speedup_vs_bf16": v} for m, v in ((64, 1.8), (96, 1.5), (128, 1.3))])
    report(results)
    head = pd.read_csv(results / "tables/headline.csv")
    by = {(r.claim, r.setting): r for r in head.itertuples()}
    setting = "qwen2.5-7b, LoRA r32, batch 64, prompt 256 / 1024 generated"
    assert by["rollout tokens/s, NVFP4 / BF16", setting].value == pytest.approx(1.5)
    assert by["rollout tokens/s, ours / vLLM (NVFP4)", setting].value == pytest.approx(1.25)
    assert ("rollout tokens/s, ours / vLLM (BF16)", setting) not in by  # with LoRA: not run
    unadapted = by["rollout tokens/s, ours NVFP4 + LoRA / vLLM BF16 without", setting]
    assert unadapted.value == pytest.approx(0.75)
    grpo = "qwen2.5-7b, LoRA r32, batch 64 (8 samples a prompt), prompt 256 / 1024 generated"
    assert by["rollout tokens/s, NVFP4 / BF16", grpo].value == pytest.approx(1.5)
    assert sum(c.startswith("rollout") for c, _ in by) == 4  # other ranks and lengths: no
    step = by["RL step, LoRA time / qerl time", "qwen2.5-7b, 4 prompts x 8 x 512 tokens, "
              "LoRA r32"]
    assert step.value == pytest.approx(1.25) and step.paper == 1.2 and step.card == CARD
    largest = by["largest qerl RL step on one card", "qwen2.5-7b, 4 x 8 x 512 tokens"]
    assert (largest.value, largest.unit) == (40.0, "GB peak")
    matmul = {s: r.value for (c, s), r in by.items() if c.startswith("NVFP4 matmul")}
    assert matmul == {"qwen2.5-7b gate_up, forward, M = 64 rows": 1.8,
                      "qwen2.5-7b gate_up, forward, M = 128 rows": 1.3}  # M = 96: not quoted


def test_a_ratio_pairs_rows_of_one_run_only(results):
    """The newest BF16 and NVFP4 rows of a setting can come from runs days apart, or from
    two versions of qerl run minutes apart: their ratio is left empty, as a step's speed
    against LoRA's is."""
    rows = [{"card": CARD, "model": "qwen2.5-7b", "weights": w, "lora_rank": 32, "batch": b,
             "prompt_len": 256, "gen_len": 1024, "fused": 1, "date": d, "tok_per_s": t,
             "qerl": v}
            for w, b, d, t, v in [("bf16", 64, "2026-01-01 10:00", 1000.0, "0.1.0+a"),
                                  ("nvfp4", 64, "2026-01-01 10:20", 1500.0, "0.1.0+a"),
                                  ("vllm-nvfp4", 64, "2026-01-01 10:10", 1000.0, "0.1.0+b"),
                                  ("bf16", 128, "2026-01-01 10:00", 1000.0, "0.1.0+a"),
                                  ("nvfp4", 128, "2026-01-03 10:00", 1500.0, "0.1.0+a"),
                                  ("vllm-nvfp4", 128, "2026-01-03 10:30", 1200.0, "0.1.0+a")]]
    rows += [{**rows[0], "weights": "vllm-bf16", "lora_rank": 0, "batch": b, "date": d,
              "tok_per_s": 2000.0} for b, d in ((64, "2026-01-01 10:05"),
                                                (128, "2026-01-01 10:05"))]
    write(results / "bench/rollout/rollout_dated.csv", rows)
    report(results)
    table = pd.read_csv(results / "tables/rollout.csv")
    table = table[(table.model == "qwen2.5-7b") & (table.lora_rank == 32)].set_index("batch")
    assert table.loc[64, "nvfp4/bf16"] == pytest.approx(1.5)
    assert pd.isna(table.loc[128, "nvfp4/bf16"])  # two days apart
    assert table.loc[128, "nvfp4/vllm"] == pytest.approx(1.25)  # half an hour apart
    assert pd.isna(table.loc[64, "nvfp4/vllm"])  # minutes apart, another commit
    assert table.loc[64, "nvfp4/vllm-bf16 no LoRA"] == pytest.approx(0.75)
    assert pd.isna(table.loc[128, "nvfp4/vllm-bf16 no LoRA"])  # two days apart


def test_a_later_run_of_one_weights_keeps_the_ratio_an_earlier_run_paired(results):
    """A run measuring NVFP4 alone (beside vLLM's unadapted BF16) does not empty the
    ratios an earlier run measured with every weights: each ratio comes from the latest run
    that measured both of its weights, while each weights' column shows its latest row."""
    base = {"card": CARD, "model": "qwen2.5-7b", "lora_rank": 32, "batch": 64,
            "prompt_len": 256, "gen_len": 1024, "fused": 1, "qerl": "0.1.0+a"}
    rows = [{**base, "weights": w, "date": d, "tok_per_s": t}
            for w, d, t in [("bf16", "2026-01-01 10:00", 1000.0),
                            ("nvfp4", "2026-01-01 10:10", 1500.0),
                            ("vllm-nvfp4", "2026-01-01 10:20", 1000.0),
                            ("nvfp4", "2026-01-02 10:00", 1900.0),  # a run of NVFP4 alone...
                            ("bf16", "2026-01-02 10:40", 1000.0),  # ... paired again here
                            ("nvfp4", "2026-01-03 10:00", 1600.0)]]
    rows.append({**base, "weights": "vllm-bf16", "lora_rank": 0, "date": "2026-01-03 10:30",
                 "tok_per_s": 2000.0})
    write(results / "bench/rollout/rollout_dated.csv", rows)
    report(results)
    table = pd.read_csv(results / "tables/rollout.csv")
    row = table[(table.model == "qwen2.5-7b") & (table.lora_rank == 32)].set_index("batch")
    assert row.loc[64, "nvfp4"] == 1600.0  # the latest row
    assert row.loc[64, "nvfp4/bf16"] == pytest.approx(1.9)  # the latest pair: Jan 2
    assert row.loc[64, "nvfp4/vllm"] == pytest.approx(1.5)  # Jan 1, vLLM not rerun since
    assert row.loc[64, "nvfp4/vllm-bf16 no LoRA"] == pytest.approx(0.8)  # Jan 3


def test_the_rank_figure_compares_one_run_and_stale_outputs_go(tmp_path):
    """A rank panel draws only the ranks its newest run measured: once a later run measures
    one rank alone, the panel (and a figure of it alone) is gone, not left showing ranks
    from two runs; figures the report did not draw stay."""
    def row(rank, date, version):
        return {"card": CARD, "model": "qwen2.5-7b", "weights": "nvfp4", "lora_rank": rank,
                "batch": 1, "prompt_len": 256, "gen_len": 512, "fused": 1, "date": date,
                "tok_per_s": 100.0 + rank, "qerl": version}

    results = tmp_path / "results"
    early = [row(16, "2026-01-01 10:00", "0.1.0+a"), row(64, "2026-01-01 10:10", "0.1.0+a")]
    write(results / "bench/rollout/rollout_ranks.csv", early)
    figure = f"rollout_by_rank_{CARD.replace(' ', '_')}.png"
    keep = results / "figures/mine.png"  # a user's own figure
    keep.parent.mkdir(parents=True, exist_ok=True)
    keep.write_bytes(b"not the report's")
    assert figure in report(results)["figures"]
    write(results / "bench/rollout/rollout_ranks.csv",
          [*early, row(32, "2026-01-01 10:20", "0.1.0+b")])  # minutes later, another commit
    written = report(results)
    assert figure not in written["figures"] and not (results / "figures" / figure).exists()
    assert written["removed"] == [str(results / "figures" / figure)] and keep.exists()


def test_the_rank_figure_draws_the_engines_ranks_not_vllms_unadapted_rows(tmp_path):
    """vLLM's rows without an adapter (rank 0) measured beside one engine rank are no rank
    comparison: no rank figure is drawn of them."""
    def row(weights, rank):
        return {"card": CARD, "model": "qwen2.5-7b", "weights": weights, "lora_rank": rank,
                "batch": 128, "prompt_len": 256, "gen_len": 1024, "fused": 1 if rank else None,
                "date": "2026-01-01 10:00", "tok_per_s": 1000.0 + rank, "qerl": "0.1.0+a"}

    results = tmp_path / "results"
    write(results / "bench/rollout/rollout_x.csv", [row("nvfp4", 32), row("vllm-bf16", 0)])
    assert not [f for f in report(results)["figures"] if "rollout_by_rank" in f]


def test_rollout_rows_from_before_the_group_column_are_groups_of_one(results):
    """Rows written before --group existed had every prompt distinct: they are group 1 (their
    keys unchanged), and a newer group-1 row of the same setting replaces them; a
    GRPO-shaped row (group 8) is a setting of its own."""
    def row(group, t, date):
        one = {"card": CARD, "model": "qwen2.5-7b", "weights": "bf16", "lora_rank": 32,
               "batch": 64, "prompt_len": 256, "gen_len": 1024, "fused": 1, "date": date,
               "tok_per_s": t}
        return one if group is None else {**one, "group": group}

    write(results / "bench/rollout/rollout_x.csv", [row(None, 1000.0, "2026-01-01 10:00"),
                                                    row(1, 1100.0, "2026-01-02 10:00"),
                                                    row(8, 1300.0, "2026-01-02 10:10")])
    report(results)
    table = pd.read_csv(results / "tables/rollout.csv")
    table = table[table.model == "qwen2.5-7b"].set_index("group")
    assert sorted(table.index) == [1, 8]
    assert table.loc[1, "bf16"] == 1100.0 and table.loc[8, "bf16"] == 1300.0
    keys = pd.read_csv(results / "tables/values.csv").key
    assert any("batch=64,group=8,prompt_len=256" in k for k in keys)
    assert not any("group=1" in k for k in keys)


def test_the_rollout_phases_table_splits_each_rows_time(results):
    """Each engine's time to the first token and decode step, vLLM's beside the engine's
    (it has no fused setting); rows from before the phases were timed are left out."""
    rows = [{"card": CARD, "model": "qwen2.5-7b", "weights": w, "lora_rank": 32, "batch": b,
             "group": 1, "prompt_len": 256, "gen_len": 1024, "fused": f,
             "date": "2026-01-01 10:00", "tok_per_s": 1000.0, "first_token_s": first,
             "step_ms": step}
            for w, b, f, first, step in [("bf16", 16, 1, None, None),
                                         ("bf16", 32, 1, 0.33, 5.7),
                                         ("nvfp4", 32, 1, 0.34, 5.3),
                                         ("vllm-nvfp4", 32, None, 0.2, 5.4)]]
    write(results / "bench/rollout/rollout_phases.csv", rows)
    report(results)
    table = pd.read_csv(results / "tables/rollout_phases.csv")
    table = table[table.model == "qwen2.5-7b"]
    assert list(table.batch) == [32] and list(table.fused) == [1]
    one = table.iloc[0]
    assert (one["bf16 first token s"], one["nvfp4 step ms"]) == (0.33, 5.3)
    assert (one["vllm-nvfp4 first token s"], one["vllm-nvfp4 step ms"]) == (0.2, 5.4)


def test_the_rollout_table_compares_kv_cache_formats_within_one_run(results):
    """Each KV cache format is a row of its own, and every ratio between weights (NVFP4 over
    BF16, ours over vLLM, over vLLM's BF16 without an adapter) pairs rows of one format;
    each weights' fp8 cache over its own BF16 one pairs rows of one run. Rows from before
    --kv-cache are BF16's, their keys unchanged; the headline keeps to the BF16 cache."""
    base = {"card": CARD, "model": "qwen2.5-7b", "batch": 64, "prompt_len": 256,
            "gen_len": 1024, "date": "2026-01-02 10:00", "run": "r1"}
    rows = [{**base, "weights": w, "lora_rank": r, "fused": f, "kv_cache": c, "tok_per_s": t}
            for w, r, f, c, t in [("bf16", 32, 1, "bf16", 1000.0),
                                  ("nvfp4", 32, 1, "bf16", 1500.0),
                                  ("vllm-nvfp4", 32, None, "bf16", 1200.0),
                                  ("vllm-bf16", 0, None, "bf16", 2000.0),
                                  ("bf16", 32, 1, "fp8", 1100.0),
                                  ("nvfp4", 32, 1, "fp8", 1800.0),
                                  ("vllm-nvfp4", 32, None, "fp8", 1500.0),
                                  ("vllm-bf16", 0, None, "fp8", 2400.0)]]
    rows.append({**rows[5], "batch": 128, "date": "2026-01-03 10:00", "run": "r2"})
    write(results / "bench/rollout/rollout_formats.csv", rows)
    before = {**base, "weights": "nvfp4", "lora_rank": 32, "fused": 1, "batch": 128,
              "date": "2026-01-01 10:00", "run": "r0", "tok_per_s": 1700.0}
    write(results / "bench/rollout/rollout_before.csv", [before])  # no kv_cache column
    report(results)
    table = pd.read_csv(results / "tables/rollout.csv")
    table = table[table.model == "qwen2.5-7b"].set_index(["lora_rank", "batch", "kv_cache"])
    bf16, fp8 = table.loc[(32, 64, "bf16")], table.loc[(32, 64, "fp8")]
    assert (bf16.nvfp4, fp8.nvfp4) == (1500.0, 1800.0)
    assert (bf16["nvfp4/bf16"], fp8["nvfp4/bf16"]) == pytest.approx((1.5, 1800 / 1100))
    assert (bf16["nvfp4/vllm"], fp8["nvfp4/vllm"]) == pytest.approx((1.25, 1.2))
    assert (bf16["nvfp4/vllm-bf16 no LoRA"], fp8["nvfp4/vllm-bf16 no LoRA"]) == pytest.approx(
        (0.75, 0.75))
    assert fp8["nvfp4 fp8/bf16 cache"] == pytest.approx(1.2)
    assert fp8["bf16 fp8/bf16 cache"] == pytest.approx(1.1)
    assert fp8["vllm-nvfp4 fp8/bf16 cache"] == pytest.approx(1.25)
    assert table.loc[(0, 64, "fp8"), "vllm-bf16 fp8/bf16 cache"] == pytest.approx(1.2)
    assert pd.isna(bf16["nvfp4 fp8/bf16 cache"])  # on the fp8 row only
    assert table.loc[(32, 128, "bf16"), "nvfp4"] == 1700.0  # from before the option
    assert pd.isna(table.loc[(32, 128, "fp8"), "nvfp4 fp8/bf16 cache"])  # two runs
    keys = pd.read_csv(results / "tables/values.csv").key
    assert (f"rollout/qwen2.5-7b/{CARD}/nvfp4/lora_rank=32,batch=128,prompt_len=256,"
            "gen_len=1024,fused=1/tok_per_s") in set(keys)
    assert sum("kv_cache=fp8" in k for k in keys) == 5 and not any("=bf16" in k for k in keys)
    head = pd.read_csv(results / "tables/headline.csv")
    claims = head[head.claim == "rollout tokens/s, NVFP4 / BF16"]
    assert claims.value.tolist() == pytest.approx([1.5])


def test_the_decode_step_tables_compare_kv_cache_formats_within_one_run(tmp_path):
    """A decode step in each KV cache format is a row of its own: NVFP4 over BF16 within a
    format, each weights' step in fp8 against its own in BF16 (a speed, above 1: fp8 is
    faster) from one run; the parts table lists each format's."""
    rows = [{"date": "2026-01-02 10:00", "run": "r1", "card": CARD, "model": "m",
             "weights": w, "lora_rank": 32, "fused": 1, "kv_cache": c, "batch": 64,
             "context": 700, "step_ms": ms, "matmul_ms": 1.0}
            for w, c, ms in [("bf16", "bf16", 8.0), ("nvfp4", "bf16", 6.0),
                             ("bf16", "fp8", 7.0), ("nvfp4", "fp8", 5.0)]]
    write(tmp_path / "bench/decode_step_x.csv", rows)
    report(tmp_path)
    table = pd.read_csv(tmp_path / "tables/decode_step.csv").set_index("kv_cache")
    assert table["bf16/nvfp4"].to_dict() == pytest.approx({"bf16": 8 / 6, "fp8": 1.4})
    assert table.loc["fp8", "nvfp4 bf16/fp8 cache"] == pytest.approx(1.2)
    assert table.loc["fp8", "bf16 bf16/fp8 cache"] == pytest.approx(8 / 7)
    assert pd.isna(table.loc["bf16", "nvfp4 bf16/fp8 cache"])
    parts = pd.read_csv(tmp_path / "tables/decode_step_parts.csv")
    assert list(zip(parts.weights, parts.kv_cache, strict=True)) == [
        ("bf16", "bf16"), ("nvfp4", "bf16"), ("bf16", "fp8"), ("nvfp4", "fp8")]


def test_tables_put_the_papers_numbers_beside_ours(results):
    (results / "bench/notes.txt").write_text("a file of no kind the report knows")
    (results / "run.json").write_text("{}")  # the workflow's record of the run
    (results / "rehearsal/tables").mkdir(parents=True)  # a results folder of its own
    (results / "rehearsal/tables/values.csv").write_text("key,value\n")
    (results / "rehearsal/bench").mkdir()
    (results / "rehearsal/bench/rollout_x.csv").write_text("card\n")
    (results / "eval/run.json").write_text("{}")  # not beside the tables: unread
    written = report(results)
    assert written["unread"] == [str(results / "bench/notes.txt"),
                                 str(results / "eval/run.json")]
    assert set(written["tables"]) == {"status", "headline", "accuracy", "external", "rollout",
                                      "training", "efficiency", "science", "entropy",
                                      "versus_paper"}
    study = pd.read_csv(results / "tables/science.csv").set_index("variant")
    assert study.loc["qerl", "seeds"] == 2 and study.loc["qerl", "steps"] == 4
    assert study.loc["qerl", "reward (last quarter) mean"] == pytest.approx(0.85)
    assert study.loc["qerl", "reward (last quarter) std"] == pytest.approx(0.1 / 2**0.5)
    assert study.loc["qerl", "reward growth mean"] == pytest.approx(0.6)  # step 4 - step 1
    assert study.loc["lora", "reward growth mean"] == pytest.approx(0.3)
    assert study.loc["lora", "gsm8k avg@4 mean"] == pytest.approx(0.15)
    assert study.loc["lora", "gsm8k avg@4 seeds"] == 2
    assert study.loc["qerl", "learning rate"] == pytest.approx(2e-4)
    assert study.loc["qerl", "card"] == CARD
    assert "science_smol.png" in written["figures"]
    efficiency = pd.read_csv(results / "tables/efficiency.csv").set_index("method")
    assert efficiency.loc["qerl", "speed_vs_lora"] == pytest.approx(1.25)
    assert pd.isna(efficiency.loc["qlora", "speed_vs_lora"])  # a day apart: another run
    assert efficiency.loc["qerl", "paper speed vs lora"] == 1.2
    # 1.25 against the paper's 1.2 +- 0.12 (a tenth of it: paper.csv's band)
    assert (efficiency.loc["qerl", "band"], efficiency.loc["qerl", "reproduced"]) == (0.12, "yes")
    assert pd.isna(efficiency.loc["lora", "reproduced"])  # the paper's reference: no band
    accuracy = pd.read_csv(results / "tables/accuracy.csv")
    row = accuracy[(accuracy.recipe == "gsm8k") & (accuracy.bench == "gsm8k")].iloc[0]
    assert (row.ours, row.paper, row.band) == (pytest.approx(90.0), 90.8, 2.5)
    assert row.delta == pytest.approx(-0.8) and row.reproduced == "yes"
    math = accuracy[(accuracy.recipe == "gsm8k") & (accuracy.bench == "math500")].iloc[0]
    assert (math.ours, math.paper, math.band) == (pytest.approx(75.0), 77.4, 5.5)
    assert math.reproduced == "yes"  # 2.4 points under, within 5.5
    base = accuracy[accuracy.recipe == "base"].iloc[0]
    assert base.ours == pytest.approx(80.0) and pd.isna(base.paper)
    assert pd.isna(base.reproduced)
    rollout = pd.read_csv(results / "tables/rollout.csv").set_index("lora_rank")
    assert rollout.loc[16, "nvfp4/bf16"] == pytest.approx(1.5)
    assert rollout.loc[16, "paper qerl/lora"] == pytest.approx(95.3 / 65.4)
    assert rollout.loc[32, "paper qerl/lora"] == pytest.approx(92.9 / 63.1)
    training = pd.read_csv(results / "tables/training.csv").set_index("method")
    assert training.loc["qerl", "reward (last)"] == pytest.approx(0.3)
    assert training.loc["lora", "steps"] == 2
    card = CARD.replace(" ", "_")
    assert {"curves_tiny_smoke.png", f"rollout_by_rank_{card}.png", f"step_{card}.png",
            "entropy_smol_cpu.png"} <= set(written["figures"])
    assert all((results / "figures" / f).stat().st_size > 1000 for f in written["figures"])


def test_every_number_has_a_stable_key(results):
    report(results)
    values = pd.read_csv(results / "tables/values.csv").set_index("key").value
    assert values["eval/qwen2.5-7b-instruct/gsm8k/qerl/math500/pass@1"] == 0.75
    assert values["external/qwen2.5-7b-instruct/base/lm-eval/gsm8k/exact_match,strict-match"] \
        == 0.85
    assert values["train/tiny/smoke/qerl/step2/aqn/sigma"] == 0.01
    rollout = f"rollout/qwen2.5-14b/{CARD}/nvfp4/lora_rank=32,batch=32,prompt_len=256"
    assert values[f"{rollout}/tok_per_s"] == 1200.0
    assert values["science/smol/qerl/seed1/step4/reward"] == pytest.approx(0.9)
    assert values["held-out/smol/lora/seed1/gsm8k/avg@4"] == pytest.approx(0.2)
    assert values["entropy/smol/cpu/nvfp4/own_entropy"] == 1.9
    step = f"step/qwen2.5-7b/{CARD}/qerl/lora_rank=32,prompts=4,generations=8,completion=512"
    assert values[f"{step},micro_batch=8,grad_ckpt=0/speed_vs_lora"] == pytest.approx(1.25)


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
    # Every value as expected, but a file that no table reads: a result lost.
    expected.write_text("key,value,tolerance\ntrain/tiny/smoke/qerl/step2/reward,0.3,0.001\n")
    report(results, expected=expected)
    (results / "train/tiny/smoke/qerl/notes.csv").write_text("a,b\n")
    with pytest.raises(DriftError, match="no table reads: .*notes.csv"):
        report(results, expected=expected)


def test_an_empty_results_folder_gives_no_tables(tmp_path):
    written = report(tmp_path)
    assert written["tables"] == [] and written["figures"] == [] and written["unread"] == []
    assert pd.read_csv(tmp_path / "tables/values.csv").empty


def test_a_missing_results_folder_or_paper_file_is_named(tmp_path):
    assert main(["report", "--results", str(tmp_path / "nowhere")]) == 2
    with pytest.raises(QerlError, match="no results folder at .*nowhere"):
        report(tmp_path / "nowhere")
    with pytest.raises(QerlError, match="no paper numbers at .*paper.csv"):
        report(tmp_path, paper=tmp_path / "paper.csv")


def test_a_speedup_row_says_on_which_days_its_cells_were_measured(results):
    """A row of the kernels table can gather cells from runs days apart (a rerun at some M
    only): its "measured" column names the span, so an older version's numbers show."""
    write(results / "bench/kernels_x.csv",
          [{"date": d, "card": CARD, "model": "qwen2.5-7b", "layer": layer, "op": "fwd",
            "M": m, "speedup_vs_bf16": 1.0}
           for d, layer, m in [("2026-01-01 10:00", "gate_up", 64), ("2026-01-03 09:00",
                                                                    "gate_up", 128),
                               ("2026-01-03 09:00", "down", 64), ("", "down", 128),
                               ("", "o", 64)]])  # rows of CSVs from before the date column
    report(results)
    table = pd.read_csv(results / "tables/kernels.csv", keep_default_na=False).set_index("layer")
    assert table.loc["gate_up", "measured"] == "2026-01-01 .. 2026-01-03"
    assert table.loc["down", "measured"] == "2026-01-03"
    assert table.loc["o", "measured"] == ""


def test_a_rerun_benchmark_replaces_its_rows_and_keeps_other_settings(tmp_path):
    """Rows of the same measurement (a rerun appends) keep the newest; a row that differs
    in any setting (here the generated length, or the fused engine) is its own."""
    rows = [{"card": CARD, "model": "m", "weights": "nvfp4", "lora_rank": 32, "batch": 16,
             "prompt_len": 256, "gen_len": g, "fused": f, "tok_per_s": t}
            for g, f, t in [(512, 1, 100.0), (1024, 1, 90.0), (1024, 0, 50.0), (512, 1, 110.0)]]
    write(tmp_path / "bench/rollout_x.csv", rows)
    values = collect(tmp_path).values.set_index("key").value
    label = "nvfp4/lora_rank=32,batch=16,prompt_len=256"
    assert values[f"rollout/m/{CARD}/{label},gen_len=512,fused=1/tok_per_s"] == 110.0
    assert values[f"rollout/m/{CARD}/{label},gen_len=1024,fused=1/tok_per_s"] == 90.0
    assert values[f"rollout/m/{CARD}/{label},gen_len=1024,fused=0/tok_per_s"] == 50.0


def test_a_step_is_compared_with_lora_only_at_the_same_settings_and_run():
    """Rows of other settings (another L) are not compared with each other's LoRA, nor is a
    LoRA step measured over an hour apart (another run) or by another version of qerl."""
    same = {"card": CARD, "model": "m", "lora_rank": 32, "prompts": 2, "generations": 8,
            "micro_batch": 8, "grad_ckpt": 1}
    frame = pd.DataFrame([
        {**same, "method": "lora", "completion": 512, "step_s": 10.0},
        {**same, "method": "qerl", "completion": 512, "step_s": 5.0},
        {**same, "method": "qerl", "completion": 2048, "step_s": 8.0}])
    assert speed_vs_lora(frame).tolist()[:2] == [1.0, 2.0]
    assert pd.isna(speed_vs_lora(frame).iloc[2])
    frame["date"] = ["2026-01-01 10:00", "2026-01-01 11:30", "2026-01-01 10:40"]
    assert pd.isna(speed_vs_lora(frame).iloc[1])
    frame.loc[1, "date"] = "2026-01-01 10:50"
    assert speed_vs_lora(frame).iloc[1] == 2.0
    frame["qerl"] = ["0.1.0+a", "0.1.0+b", "0.1.0+a"]  # minutes apart, another commit
    assert pd.isna(speed_vs_lora(frame).iloc[1])


def test_rows_that_name_their_run_pair_by_it_and_older_rows_by_their_dates():
    """A benchmark row names its invocation (``run``): two rows of one run pair however far
    apart their dates (a long run), two runs do not however close; a row from before the run
    ids pairs by date and version, as before."""
    same = {"card": CARD, "model": "m", "lora_rank": 32, "prompts": 2, "generations": 8,
            "completion": 512, "micro_batch": 8, "grad_ckpt": 1, "qerl": "0.1.0+a"}
    frame = pd.DataFrame([
        {**same, "method": "lora", "step_s": 10.0, "date": "2026-01-01 10:00", "run": "r1"},
        {**same, "method": "qerl", "step_s": 5.0, "date": "2026-01-01 13:00", "run": "r1"}])
    assert speed_vs_lora(frame).tolist() == [1.0, 2.0]  # three hours apart, one run
    frame.loc[1, ["date", "run"]] = ["2026-01-01 10:05", "r2"]
    assert pd.isna(speed_vs_lora(frame).iloc[1])  # minutes apart, two runs
    frame.loc[1, "run"] = None  # measured before run ids: the dates decide
    assert speed_vs_lora(frame).iloc[1] == 2.0
    frame.loc[1, "date"] = "2026-01-01 13:00"
    assert pd.isna(speed_vs_lora(frame).iloc[1])


def test_every_row_an_invocation_writes_names_that_invocation(tmp_path):
    from qerl.record import append_rows, provenance

    path = tmp_path / "rows.csv"
    append_rows(path, [{**provenance("cpu"), "x": 1}, {**provenance("cpu"), "x": 2}])
    runs = pd.read_csv(path).run
    assert runs.notna().all() and runs.nunique() == 1


def test_a_later_lora_step_leaves_the_speed_an_earlier_run_measured():
    """QLoRA measured beside LoRA, then LoRA alone again by a newer qerl: QLoRA's speed is
    still the one its own run measured, and a LoRA step out of memory pairs with nothing."""
    same = {"card": CARD, "model": "m", "lora_rank": 32, "prompts": 2, "generations": 8,
            "completion": 512, "micro_batch": 8, "grad_ckpt": 1}
    every = pd.DataFrame([
        {**same, "method": "lora", "step_s": 10.0, "date": "2026-01-01 10:00", "qerl": "a"},
        {**same, "method": "qlora", "step_s": 20.0, "date": "2026-01-01 10:20", "qerl": "a"},
        {**same, "method": "lora", "step_s": 8.0, "date": "2026-01-02 10:00", "qerl": "b"},
        {**same, "method": "qerl", "step_s": 4.0, "date": "2026-01-02 10:10", "qerl": "b"},
        {**same, "method": "lora", "step_s": None, "date": "2026-01-03 10:00", "qerl": "c"}])
    latest = every.drop_duplicates("method", keep="last")
    speed = speed_vs_lora(latest, every).set_axis(latest.method)
    assert speed["qlora"] == pytest.approx(0.5)  # its run's LoRA, not the newer one
    assert speed["qerl"] == pytest.approx(2.0)
    assert pd.isna(speed["lora"])  # its newest run ran out of memory


def test_the_committed_results_draw(tmp_path):
    """Every figure of the committed results (both cards' kernels, rollouts and steps, the
    study, the entropy runs) is drawn."""
    import shutil

    shutil.copytree(RESULTS, tmp_path / "results",
                    ignore=shutil.ignore_patterns("tables", "figures"))
    figures = report(tmp_path / "results")["figures"]
    for name in ("kernels_NVIDIA_H200.png", "rollout_by_rank_NVIDIA_H100_80GB_HBM3.png",
                 "rollout_speedup_NVIDIA_H200.png", "step_NVIDIA_H100_80GB_HBM3.png",
                 "science_smollm2-135m-instruct.png",
                 "entropy_smollm2-135m-instruct_AMD_EPYC.png"):
        assert name in figures
    assert all((tmp_path / "results/figures" / f).stat().st_size > 1000 for f in figures)


def test_a_results_file_that_cannot_be_read_is_named(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench/rollout_x.csv").write_text("card,model,tok_per_s\nA,m,1.0\n")
    with pytest.raises(QerlError, match=r"rollout_x.csv: rollout results need the column\(s\) "
                                        r"\['weights'\]"):
        collect(tmp_path)
    (tmp_path / "bench/rollout_x.csv").write_text('card,"model\nA,m,1\n')
    with pytest.raises(QerlError, match="rollout_x.csv: cannot be read as rollout results"):
        collect(tmp_path)


def test_vllms_rollout_rows_sit_beside_the_engines(tmp_path):
    """vLLM's rows (no fused setting) share the engine's row as it runs (fused 1), with our
    rate over vLLM's on the same weights; its rows without an adapter stand alone."""
    engine = [{"card": CARD, "model": "m", "weights": w, "lora_rank": 32, "batch": 8,
               "prompt_len": 256, "gen_len": 64, "fused": f, "tok_per_s": t}
              for w, f, t in [("bf16", 1, 1000.0), ("nvfp4", 1, 1500.0), ("nvfp4", 0, 700.0)]]
    vllm = [{"card": CARD, "model": "m", "weights": w, "lora_rank": r, "batch": 8,
             "prompt_len": 256, "gen_len": 64, "fused": None, "tok_per_s": t}
            for w, r, t in [("vllm-bf16", 32, 800.0), ("vllm-nvfp4", 32, 1200.0),
                            ("vllm-nvfp4", 0, 2000.0)]]
    write(tmp_path / "bench/rollout_x.csv", engine + vllm)
    report(tmp_path)
    table = pd.read_csv(tmp_path / "tables/rollout.csv").set_index(["lora_rank", "fused"])
    assert table.loc[(32, 1), "bf16/vllm"] == pytest.approx(1.25)
    assert table.loc[(32, 1), "nvfp4/vllm"] == pytest.approx(1.25)
    assert table.loc[(32, 1), "nvfp4/bf16"] == pytest.approx(1.5)
    assert pd.isna(table.loc[(32, 0), "vllm-nvfp4"])
    assert table.loc[(0, 1), "vllm-nvfp4"] == 2000.0 and pd.isna(table.loc[(0, 1), "nvfp4"])


def test_a_decode_step_shows_its_time_outside_its_kernels_where_measured(tmp_path):
    """The replay's time less the time some kernel runs (overlaps once), per weights; rows
    with only the kernels' plain sum (a side stream's overlap counted twice: more than the
    step) or from before either was recorded show none rather than a made-up number."""
    rows = [{"date": "2026-01-02 10:00", "card": CARD, "model": "m", "weights": w,
             "lora_rank": 32, "fused": 1, "batch": b, "context": 700, "step_ms": step,
             "kernels": 381, "kernel_ms": summed, "busy_ms": busy}
            for w, b, step, summed, busy in [("bf16", 32, 6.0, 6.6, 5.5),
                                             ("nvfp4", 32, 5.0, 4.25, 4.25),
                                             ("nvfp4", 64, 6.5, 6.9, None),
                                             ("nvfp4", 128, 8.0, None, None)]]
    write(tmp_path / "bench/decode_step_x.csv", rows)
    report(tmp_path)
    table = pd.read_csv(tmp_path / "tables/decode_step.csv").set_index("batch")
    assert table.loc[32, "bf16 between kernels ms"] == pytest.approx(0.5)
    assert table.loc[32, "nvfp4 between kernels ms"] == pytest.approx(0.75)
    assert table.loc[32, "bf16/nvfp4"] == pytest.approx(1.2)
    for batch in (64, 128):
        assert pd.isna(table.loc[batch, "nvfp4 between kernels ms"])
    assert table.loc[64, "nvfp4"] == 6.5


def test_a_decode_steps_ceiling_puts_every_layers_projections_at_theirs(tmp_path):
    """BF16's step with each of the model's layers' four projections at their ceiling over
    cuBLAS (here the bytes: half of cuBLAS's time) and the rest as it is; none where a
    projection's time at that batch, or the model's layer count, is unknown."""
    def kernel(model, layer, m, bf16_us):
        return {"date": "2026-01-01 10:00", "card": CARD, "model": model, "layer": layer,
                "op": "fwd", "M": m, "N": 1024, "K": 1024, "bf16_us": bf16_us,
                "ours_us": bf16_us, "floor_us": bf16_us / 2, "speedup_vs_bf16": 1.0}

    projections = {"qkv": 10.0, "o": 5.0, "gate_up": 40.0, "down": 25.0}  # 80 us a layer
    kernels = [kernel(model, layer, 128, us) for model in ("qwen2.5-7b", "m")
               for layer, us in projections.items()]
    kernels += [kernel("qwen2.5-7b", layer, 64, us) for layer, us in projections.items()
                if layer != "o"]
    # cuBLAS's rate from 2048 rows, fast enough that the bytes bound every ceiling at 128
    kernels += [kernel(model, "down", 2048, 1.0) for model in ("qwen2.5-7b", "m")]
    write(tmp_path / "bench/kernels_x.csv", kernels)
    steps = [{"date": "2026-01-02 10:00", "card": CARD, "model": model, "weights": w,
              "lora_rank": 32, "fused": 1, "batch": b, "context": 700, "step_ms": ms}
             for model in ("qwen2.5-7b", "m") for b in (64, 128)
             for w, ms in (("bf16", 8.0), ("nvfp4", 7.0))]
    write(tmp_path / "bench/decode_step_x.csv", steps)
    report(tmp_path)
    table = pd.read_csv(tmp_path / "tables/decode_step.csv").set_index(["model", "batch"])
    saved_ms = 28 * 80.0 / 2 / 1e3  # Qwen2.5-7B's 28 layers, each 40 us sooner
    assert table.loc[("qwen2.5-7b", 128), "ceiling bf16/nvfp4"] == pytest.approx(
        8.0 / (8.0 - saved_ms))
    assert pd.isna(table.loc[("qwen2.5-7b", 64), "ceiling bf16/nvfp4"])  # o not timed
    assert pd.isna(table.loc[("m", 128), "ceiling bf16/nvfp4"])  # layers unknown


def test_a_decode_steps_parts_are_listed_where_its_kernels_were_summed_by_part(tmp_path):
    """The parts table lists each step whose kernel time was summed by part, with its replay
    time, its sampling and a prefill's times; a row from before the parts were recorded is
    not listed."""
    parts = {"matmul_ms": 4.4, "lora_ms": 1.8, "attention_ms": 1.4, "norm_ms": 0.3,
             "other_ms": 0.5, "sampling_ms": 0.1}
    rows = [{"date": "2026-01-02 10:00", "card": CARD, "model": "m", "weights": "nvfp4",
             "lora_rank": 32, "fused": 1, "batch": 128, "context": 700, "step_ms": 8.2,
             "kernels": 381, "kernel_ms": 8.4, "busy_ms": 8.1, **parts, "prefill_len": 256,
             "prefill_ms": 90.0, "prefill_busy_ms": 12.0},
            {"date": "2026-01-02 10:00", "card": CARD, "model": "m", "weights": "nvfp4",
             "lora_rank": 32, "fused": 1, "batch": 64, "context": 700, "step_ms": 6.0,
             "kernels": 381, "kernel_ms": 6.3, "busy_ms": 5.8}]
    write(tmp_path / "bench/decode_step_x.csv", rows)
    report(tmp_path)
    table = pd.read_csv(tmp_path / "tables/decode_step_parts.csv")
    assert table.batch.tolist() == [128] and table.weights.tolist() == ["nvfp4"]
    assert table.iloc[0][list(parts)].tolist() == pytest.approx(list(parts.values()))
    assert table.step_ms.tolist() == [8.2]
    assert table[["prefill_len", "prefill_ms", "prefill_busy_ms"]].values.tolist() == [
        [256, 90.0, 12.0]]


def test_a_kernel_ceiling_is_the_longer_of_its_bytes_and_its_multiply(tmp_path):
    """The ceiling over cuBLAS BF16 at a few rows is the weight's bytes (floor_us), at many
    its multiply at the best rate cuBLAS reached on that card from RATE_FROM_M rows; a card
    with no such row has none. Its table is laid out as the kernels table, and the headline
    puts it beside the speed-up."""
    flops = 2 * 1024 * 2048  # a row's multiply: 2 M N K

    def row(card, m, bf16_us, floor_us):
        return {"card": card, "model": "qwen2.5-7b", "layer": "down", "op": "fwd", "M": m,
                "N": 1024, "K": 2048, "bf16_us": bf16_us, "ours_us": bf16_us / 2,
                "floor_us": floor_us, "speedup_vs_bf16": 2.0, "date": "2026-01-01 10:00"}

    rate = flops * 2048 / 100.0  # cuBLAS's best: M = 2048 in 100 us (4096 runs slower)
    results = tmp_path / "results"
    write(results / "bench/kernels/kernels_a.csv",
          [row(CARD, 1, 10.0, 2.0), row(CARD, 512, 40.0, 3.0), row(CARD, 2048, 100.0, 5.0),
           row(CARD, 4096, 250.0, 9.0), row("NVIDIA H200", 1, 10.0, 2.0)])
    frame = collect(results).frames["kernels"].set_index(["card", "M"]).ceiling_vs_bf16
    assert frame[CARD, 1] == pytest.approx(10.0 / 2.0)  # bytes: the multiply takes ~0.05 us
    assert frame[CARD, 512] == pytest.approx(40.0 / (flops * 512 / rate))  # multiply: 25 us
    assert frame[CARD, 2048] == pytest.approx(1.0)
    assert frame[CARD, 4096] == pytest.approx(250.0 / 200.0)
    assert pd.isna(frame["NVIDIA H200", 1])  # no row of 2048 or more: no rate
    report(results)
    table = pd.read_csv(results / "tables/kernel_ceilings.csv").set_index("card")
    assert table.loc[CARD, "M=512"] == pytest.approx(1.6)
    assert pd.isna(table.loc["NVIDIA H200", "M=1"])
    headline = pd.read_csv(results / "tables/headline.csv").set_index(["card", "setting"])
    assert headline.loc[(CARD, "qwen2.5-7b down, forward, M = 1 rows"), "ceiling"] == 5.0


def test_busy_time_counts_overlapping_kernels_once():
    from qerl.bench.decode_step import busy_ms

    # a side stream's kernel inside the main one's, one after a gap, one touching the last
    spans = [(2000.0, 2500.0), (0.0, 1000.0), (200.0, 600.0), (900.0, 1200.0),
             (2500.0, 2600.0)]
    assert busy_ms(spans) == pytest.approx(1.8)
    assert busy_ms([]) == 0.0


def test_runs_on_each_rollout_backend_sit_side_by_side_with_their_mismatch(tmp_path):
    """The same recipe trained with our engine and with vLLM: one line each in the
    training table, naming the backend, with the mean sampler/trainer mismatch."""
    root = tmp_path / "results"
    for method, backend, gap in (("qerl", "embedded", 0.04), ("qerl-vllm", "vllm", 0.05)):
        run = root / f"train/smol/backends/{method}"
        write(run / "metrics.csv", [{"step": k, "reward": 0.1 * k, "entropy": 2.0,
                                     "time/rollout_s": 1.0 + k, MISMATCH: gap + k / 100}
                                    for k in (1, 2, 3)])
        (run / "config.yaml").write_text(f"engine:\n  backend: {backend}\n")
    written = report(root)
    training = pd.read_csv(root / "tables/training.csv").set_index("method")
    assert training.loc["qerl", "backend"] == "embedded"
    assert training.loc["qerl-vllm", "backend"] == "vllm"
    assert training.loc["qerl-vllm", "mismatch |d log p| (mean)"] == pytest.approx(0.07)
    assert training.loc["qerl", "rollout (s, mean)"] == pytest.approx(3.0)
    assert "curves_smol_backends.png" in written["figures"]
    values = pd.read_csv(root / "tables/values.csv").set_index("key").value
    assert values[f"train/smol/backends/qerl-vllm/step2/{MISMATCH}"] == pytest.approx(0.07)
