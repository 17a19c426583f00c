"""The vLLM backend against a stand-in ``vllm`` module with vLLM 0.31's API shape: what it
asks vLLM to load, what it pushes before each rollout (a fresh adapter, the noised norms),
how it translates sampling requests and reads results back. Real vLLM is not installed on
these machines: loading and sampling on it are not exercised here."""

from __future__ import annotations

import sys

import pytest
import torch

from qerl.noise import AQNSettings
from qerl.policy import build_policy
from qerl.rollout import RolloutError, SamplingParams
from qerl.rollout.vllm_backend import VLLMEngine, request_seed
from tests.conftest import fresh_seed
from tests.fake_vllm import FakeLLM
from tests.test_policy import randomize_adapter


def test_each_rollout_pushes_a_fresh_adapter_and_the_noised_norms(fake_vllm, tiny_checkpoint,
                                                                   tmp_path):
    policy = build_policy("qerl", tiny_checkpoint, aqn=AQNSettings(num_stages=2),
                          total_steps=4)
    randomize_adapter(policy, fresh_seed())
    engine = VLLMEngine(policy, tmp_path, max_batch=8, max_seq_len=64)
    llm = FakeLLM.instances[0]
    assert llm.model_path == str(tmp_path / "export" / "base")
    assert llm.kwargs["enable_lora"] and llm.kwargs["max_lora_rank"] == 16
    assert (tmp_path / "export" / "base" / "config.json").read_text().count("nvfp4")

    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9,
                            stop_token_ids=(9,), seed=3)
    for step in (1, 2):
        policy.aqn.perturb(step)
        out = engine.generate([[1, 2, 3], [4, 5]], params)
        vllm_norms = dict(llm.model.named_parameters())
        for name, w in policy.norm_weights().items():
            # the training forward takes the noised norms vLLM sampled with, to the bit
            assert torch.equal(vllm_norms[name].float(), w.float()), name
        noisy = {name: w.clone() for name, w in policy.norm_weights().items()}
        sigma = policy.aqn.sigma
        policy.aqn.restore()
        restored = [not torch.equal(w, noisy[name]) for name, w in policy.norm_weights().items()
                    if name.removesuffix(".weight") in policy.aqn.weights]
        assert restored and all(restored) == (sigma > 0) == (step == 2)  # stage 0: no noise
        _, kwargs, request = llm.calls[-1]
        assert request.lora_int_id == step
        assert not (tmp_path / f"adapter-{step - 1}").exists()  # the previous one is gone
    asked = {"n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 5,
             "stop_token_ids": [9], "ignore_eos": False, "logprobs": 0}
    assert [{k: v for k, v in one.items() if k != "seed"} for one in kwargs] == [asked] * 2
    assert [one["seed"] for one in kwargs] == [request_seed(3, 0), request_seed(3, 1)]
    assert out.tokens == [[3, 7], [2, 7, 9]]
    assert out.logprobs == [[-0.5, -1.0], [-0.5, -1.0, -1.5]]
    assert out.finish_reasons == ["length", "stop"]
    with pytest.raises(RolloutError, match="at least one token"):
        engine.generate([[1], []], params)


def test_without_vllm_the_backend_says_how_to_get_it(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(RolloutError, match="pip install 'qerl\\[vllm\\]'"):
        VLLMEngine(build_policy("qerl", tiny_checkpoint), tmp_path, 4, 32)


def test_copies_of_a_prompt_get_seeds_of_their_own(fake_vllm, tiny_checkpoint, tmp_path):
    """GRPO sends each prompt several times: one seed for all would make vLLM sample the same
    completion for every copy (seen on a real vLLM: nearly every group had zero reward
    spread). Seeds differ per request, repeat per rollout seed, and stay off when unseeded."""
    engine = VLLMEngine(build_policy("qerl", tiny_checkpoint), tmp_path, 8, 32)
    llm = FakeLLM.instances[0]
    for seed in (fresh_seed(), 0):
        engine.generate([[1, 2]] * 8, SamplingParams(max_new_tokens=2, seed=seed))
        seeds = [one["seed"] for one in llm.calls[-1][1]]
        assert len(set(seeds)) == 8
        engine.generate([[1, 2]] * 8, SamplingParams(max_new_tokens=2, seed=seed))
        assert [one["seed"] for one in llm.calls[-1][1]] == seeds
    engine.generate([[1, 2]] * 3, SamplingParams(max_new_tokens=2, seed=None))
    assert [one["seed"] for one in llm.calls[-1][1]] == [None] * 3


def test_pushes_survive_trls_ref_adapter(fake_vllm, tiny_checkpoint, tmp_path):
    """rl.beta > 0: TRL's GRPOTrainer adds a frozen "ref" adapter to the policy's PeftModel,
    which PEFT saves into a ref/ subfolder; each push sends the trained adapter alone and
    removes the previous one whole (it once unlinked ref/ as a file: IsADirectoryError)."""
    policy = build_policy("qerl", tiny_checkpoint)
    policy.model.add_adapter("ref", policy.model.peft_config["default"])  # as TRL does
    policy.model.set_adapter("default")
    engine = VLLMEngine(policy, tmp_path, max_batch=4, max_seq_len=32)
    for step in (1, 2, 3):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2, seed=step))
        assert not (tmp_path / f"adapter-{step - 1}").exists()
    assert sorted(p.name for p in (tmp_path / "adapter-3").iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors"]
