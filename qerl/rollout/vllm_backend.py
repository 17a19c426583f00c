"""The vLLM backend: the embedded engine's ``generate`` on vLLM (``pip install 'qerl[vllm]'``).

vLLM loads the policy's export once (``export_for_vllm``: the NVFP4 compressed-tensors base
and the adapter); before every ``generate`` the current LoRA weights go to vLLM as a new
adapter (vLLM takes adapters from disk, keyed by an integer id, so each push writes the
small adapter files under ``workdir`` with a fresh id) and the current RMSNorm weights,
AQN's noise included, are copied into vLLM's model in place (``LLM.apply_model``). vLLM
holds them in bf16, so the policy's noised norms are rounded to the same values for the
step's training forward: noise of sigma below bf16's step (~2e-3 at a weight of ~0.3) mostly
rounds away on this backend, in sampling and training alike.

Log-probabilities come from vLLM's "processed" log-probs (after temperature, top-k and
top-p), where the embedded engine reports the tempered distribution before truncation:
equal when top-k and top-p are off.

The translation of requests and results and the push order are tested against a stand-in
module with vLLM 0.31's API shape (tests/rollout/test_vllm_backend.py); loading, sampling and
the pushes on a real vLLM by tests/rollout/test_vllm_real.py, on a GPU where vLLM is
installed beside qerl.
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import torch

from qerl.export import export_for_vllm
from qerl.policy import ADAPTER
from qerl.rollout.engine import Rollout, RolloutError
from qerl.rollout.sampling_params import SamplingParams


def _load_norms(norms: dict[str, torch.Tensor], model: torch.nn.Module) -> int:
    """Runs inside vLLM's worker: copy norm weights into the model by name."""
    params = dict(model.named_parameters())
    missing = sorted(set(norms) - set(params))
    if missing:
        raise KeyError(f"vLLM's model has no parameter(s) {missing[:3]}")
    with torch.no_grad():
        for name, value in norms.items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))
    return len(norms)


class VLLMEngine:
    """``generate(prompts, params) -> Rollout`` on vLLM, for a ``qerl`` or ``lora`` policy."""

    def __init__(self, policy, workdir: str | Path, max_batch: int, max_seq_len: int,
                 gpu_memory_utilization: float = 0.5, **llm_kwargs):
        try:
            import vllm
        except ImportError as e:
            raise RolloutError("the vLLM backend needs vllm: pip install 'qerl[vllm]'") from e
        self.vllm = vllm
        self.policy = policy
        self.max_batch = max_batch
        self.workdir = Path(workdir)
        export = export_for_vllm(policy, self.workdir / "export", overwrite=True)
        self.llm = vllm.LLM(model=str(export / "base"), enable_lora=True,
                            max_lora_rank=policy.lora.rank, max_loras=2,
                            max_num_seqs=max_batch, max_model_len=max_seq_len,
                            gpu_memory_utilization=gpu_memory_utilization,
                            logprobs_mode="processed_logprobs", **llm_kwargs)
        self.adapter_id = 0

    def push(self):
        """Send the policy's current adapter and norms to vLLM; returns the LoRARequest."""
        from vllm.lora.request import LoRARequest

        self.adapter_id += 1
        path = self.workdir / f"adapter-{self.adapter_id}"
        self.policy.model.save_pretrained(path, selected_adapters=[ADAPTER])
        weights = self.policy.norm_weights()
        norms = {name: w.detach().to(torch.bfloat16).cpu() for name, w in weights.items()}
        self.llm.apply_model(partial(_load_norms, norms))
        aqn = self.policy.aqn
        if aqn is not None and aqn.perturbed and not self.policy.lora.train_norms:
            # vLLM holds bf16 norms, the policy AQN's noisy ones in fp32: the training forward
            # takes the noised norms vLLM sampled with, so that the rollout stays on-policy
            # (restore() puts the clean fp32 weights back).
            with torch.no_grad():
                for w in weights.values():
                    w.copy_(w.to(torch.bfloat16))
        previous = self.workdir / f"adapter-{self.adapter_id - 1}"
        if previous.is_dir():  # vLLM has read it; keep the disk use to one adapter
            shutil.rmtree(previous)
        return LoRARequest(f"policy-{self.adapter_id}", self.adapter_id, str(path))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise RolloutError("every prompt needs at least one token")
        request = self.push()
        # A seed each request: vLLM seeds a request's sampler with its own seed, so one seed
        # for all would give GRPO's copies of a prompt the same completion.
        sampling = [self.vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k else -1, max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
            seed=request_seed(params.seed, i), logprobs=0) for i in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling,
                                    lora_request=request, use_tqdm=False)
        tokens, logprobs, reasons = [], [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            tokens.append(ids)
            logprobs.append([step[token].logprob
                             for step, token in zip(completion.logprobs, ids, strict=True)])
            reasons.append("stop" if completion.finish_reason == "stop" else "length")
        return Rollout(tokens, logprobs, reasons)


def request_seed(seed: int | None, index: int) -> int | None:
    """The seed of the index-th request of a rollout seeded with ``seed`` (None: unseeded):
    distinct for every request, the same on every run."""
    if seed is None:
        return None
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 62)  # 2^64 / golden ratio: spread
