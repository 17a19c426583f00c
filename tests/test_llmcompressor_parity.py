"""The acceptance check: a tiny random model saved with save_pretrained, quantized by
`qerl quantize` and by llmcompressor's NVFP4A16 recipe, gives the same bytes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from qerl.cli import main
from tests.conftest import fresh_seed, require, save_tiny_model


def llmcompressor_checkpoint(src, out):
    require("llmcompressor")
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    recipe = QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"])
    oneshot(model=model, recipe=recipe, processor=None)
    model.save_pretrained(out, save_compressed=True)


def read_all(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize(
    ("arch", "dtype", "tied"),
    [("qwen2", torch.bfloat16, False), ("qwen2", torch.float32, True),
     ("llama", torch.float16, False)],
)
def test_qerl_quantize_equals_llmcompressor_bit_for_bit(tmp_path, arch, dtype, tied):
    seed = fresh_seed()
    src = tmp_path / "src"
    save_tiny_model(src, arch=arch, dtype=dtype, seed=seed, tied=tied)
    llmcompressor_checkpoint(src, tmp_path / "llmc")
    assert main(["quantize", "--model", str(src), "--out", str(tmp_path / "qerl"), "--quiet"]) == 0

    ours, theirs = read_all(tmp_path / "qerl"), read_all(tmp_path / "llmc")
    quantized = [k for k in theirs if k.endswith("weight_packed")]
    assert len(quantized) == 14
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        if dtype == torch.bfloat16 or not t.is_floating_point() or "weight_" in name:
            assert torch.equal(as_bits(ours[name]), as_bits(t)), f"{name} (seed {seed})"
        else:  # llmcompressor keeps the model's dtype for what it leaves dense; we write bf16
            assert ours[name].dtype == torch.bfloat16
            assert torch.equal(ours[name], t.to(torch.bfloat16)), f"{name} (seed {seed})"

    ours_config = json.loads((tmp_path / "qerl" / "config.json").read_text())
    theirs_config = json.loads((tmp_path / "llmc" / "config.json").read_text())
    assert ours_config["quantization_config"] == theirs_config["quantization_config"]
