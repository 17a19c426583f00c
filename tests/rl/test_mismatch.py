"""The rollout/trainer mismatch, on CPU, with a stand-in sampler whose log-probs are off by
a known delta: every run logs it against the training forward, and truncated importance
sampling (rl.tis) weighs each token's loss by min(p_train / p_sampler, rl.tis_cap)."""

from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd
import pytest

from qerl.config import parse_config
from qerl.rl import trainer as trainer_module
from qerl.rl.run import METRICS
from tests.rl.test_train import run, settings

RATIO = "sampling/importance_sampling_ratio"
GENERATE = trainer_module.Engine.generate  # the engine's own, before any test's stand-in


def sampler_off_by(monkeypatch, delta: float) -> None:
    """The engine's sampled log-probs, each lowered by delta (the tokens are its own)."""
    def generate(self, prompts, params):
        out = GENERATE(self, prompts, params)
        return replace(out, logprobs=[[p - delta for p in row] for row in out.logprobs])

    monkeypatch.setattr(trainer_module.Engine, "generate", generate)


def alternating(completions, **_):
    """1 for every other completion: a group's two differ (a random model earns no other
    reward), so that advantages, and the loss, are not zero."""
    return [float(i % 2) for i in range(len(completions))]


def train_off_by(chat_model, out, monkeypatch, delta, **rl) -> pd.DataFrame:
    sampler_off_by(monkeypatch, delta)
    monkeypatch.setitem(trainer_module.REWARDS, "format", alternating)
    raw = settings(chat_model, out, "lora", max_steps=2)
    # (its completions all reach the length limit: unmasked, so that the loss has tokens)
    raw["rl"] = {**raw["rl"], "mask_truncated_completions": False, "rewards": {"format": 1.0},
                 "overlong": {"enabled": False}, **rl}
    run(raw)
    return pd.read_csv(out / METRICS)


@pytest.mark.parametrize("delta", [0.0, 0.5])
def test_every_run_logs_the_gap_between_sampler_and_trainer(chat_model, tmp_path,
                                                             monkeypatch, delta):
    metrics = train_off_by(chat_model, tmp_path, monkeypatch, delta)
    # The engine's own log-probs are the policy's forward up to float rounding.
    assert metrics["mismatch/logp_diff_mean"].tolist() == pytest.approx([delta] * 2, abs=1e-3)
    assert (metrics["mismatch/logp_diff_max"] >= metrics["mismatch/logp_diff_mean"]).all()
    assert metrics["mismatch/token_mult_prob_error"].tolist() == pytest.approx(
        [math.exp(delta)] * 2, rel=1e-3)
    assert f"{RATIO}/mean" not in metrics  # the embedded engine: no correction by default


def test_truncated_importance_sampling_weighs_tokens_by_the_capped_ratio(chat_model, tmp_path,
                                                                         monkeypatch):
    """p_train / p_sampler = e^delta: e^0.5 passes the cap of 3, e^2 is cut to it; the
    gradient of the first step (no update yet, the same rollouts) is the uncorrected one
    times the ratio."""
    plain = train_off_by(chat_model, tmp_path / "plain", monkeypatch, 2.0)
    below = train_off_by(chat_model, tmp_path / "below", monkeypatch, 0.5, tis=True)
    capped = train_off_by(chat_model, tmp_path / "capped", monkeypatch, 2.0, tis=True,
                          tis_cap=3.0)
    assert below[f"{RATIO}/mean"].tolist() == pytest.approx([math.exp(0.5)] * 2, rel=1e-3)
    assert capped[f"{RATIO}/min"].tolist() == capped[f"{RATIO}/max"].tolist() == [3.0, 3.0]
    assert capped["mismatch/logp_diff_mean"].tolist() == pytest.approx([2.0] * 2, abs=1e-3)
    assert plain.grad_norm[0] > 0
    # (rel: the pre-update forward and the loss forward of a bf16 model round apart)
    assert capped.grad_norm[0] == pytest.approx(3.0 * plain.grad_norm[0], rel=1e-2)
    assert below.grad_norm[0] == pytest.approx(math.exp(0.5) * plain.grad_norm[0], rel=1e-2)


def test_the_correction_is_on_by_default_only_where_vllm_or_an_fp8_cache_samples(
        chat_model, tmp_path):
    raw = settings(chat_model, tmp_path)
    assert not trainer_module.tis_enabled(parse_config(raw))
    assert trainer_module.tis_enabled(parse_config({**raw, "engine": {"backend": "vllm"}}))
    assert trainer_module.tis_enabled(parse_config({**raw, "engine": {"kv_cache": "fp8"}}))
    assert not trainer_module.tis_enabled(parse_config(
        {**raw, "engine": {"kv_cache": "fp8"}, "rl": {**raw["rl"], "tis": False}}))
    assert not trainer_module.tis_enabled(parse_config(
        {**raw, "engine": {"backend": "vllm"}, "rl": {**raw["rl"], "tis": False}}))
