"""A stand-in ``vllm`` module with vLLM 0.31's API shape (vLLM is not installable on these
machines): the ``fake_vllm`` fixture installs it; ``FakeLLM.instances`` records what the
backends asked of it."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import ClassVar

import pytest
from transformers import AutoModelForCausalLM


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


class FakeLLM:
    """Records requests; its 'model' is a transformers model with vLLM's parameter names."""

    instances: ClassVar[list] = []
    length_factor: ClassVar[int] = 1  # 0: sequences come back empty (a broken engine)

    def __init__(self, model: str, **kwargs):
        from pathlib import Path

        from transformers import AutoConfig

        self.model_path, self.kwargs, self.calls = model, kwargs, []
        self.prompts = []  # each generate's prompt token ids
        # What it was given, for tests to read after the files are gone.
        self.files = sorted(p.name for p in Path(model).iterdir())
        self.config_text = (Path(model) / "config.json").read_text()
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
        FakeLLM.instances.append(self)

    def apply_model(self, func):
        self.calls.append("apply_model")
        return [func(self.model)]

    def generate(self, prompts, sampling, lora_request, use_tqdm):
        from pathlib import Path

        assert lora_request is None or (
            Path(lora_request.lora_path) / "adapter_config.json").is_file()
        each = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        assert len(each) == len(prompts)  # as vLLM checks
        self.calls.append(("generate", [s.kwargs for s in each], lora_request))
        self.prompts.append([p["prompt_token_ids"] for p in prompts])
        outs = []
        for i, (prompt, sampling) in enumerate(zip(prompts, each, strict=True)):
            ids = [len(prompt["prompt_token_ids"]), 7, 9][: 2 + i % 2]
            if "min_tokens" in sampling.kwargs:  # a benchmark's fixed length, as asked
                ids = [7] * sampling.kwargs["min_tokens"] * self.length_factor
            steps = [{t: types.SimpleNamespace(logprob=-0.5 * (k + 1))} for k, t in
                     enumerate(ids)]
            completion = types.SimpleNamespace(token_ids=ids, logprobs=steps,
                                               finish_reason="stop" if i % 2 else "length")
            outs.append(types.SimpleNamespace(outputs=[completion]))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    vllm.SamplingParams = lambda **kwargs: types.SimpleNamespace(kwargs=kwargs)
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    for name, module in (("vllm", vllm), ("vllm.lora", lora), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, module)
    FakeLLM.instances = []
    FakeLLM.length_factor = 1
    return vllm
