"""build_policy: the four methods from every kind of source, LoRA through PEFT on the
NVFP4 base, gradients only where they belong, adapters that round-trip and load on the
BF16 base, and clear errors for bad requests."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qerl.config import LoraSettings
from qerl.errors import ArchitectureError
from qerl.nn import NVFP4Linear
from qerl.noise import AQNSettings
from qerl.policy import PolicyError, build_policy, load_adapter
from tests.conftest import (
    fresh_seed,
    require,
    require_smollm2,
    run_python,
    save_tiny_model,
    spec_weight,
    tree_digests,
)

IDS = torch.tensor([[5, 17, 99, 3, 64, 8, 120], [1, 2, 3, 4, 5, 6, 7]])


def randomize_adapter(policy, seed: int, scale: float = 0.05) -> None:
    """LoRA B starts at zero (the adapter a no-op): give every adapter weight values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def logits(policy) -> torch.Tensor:
    with torch.no_grad():
        return policy.model(IDS).logits.float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_each_method_builds_with_its_own_base_layers(tmp_path, arch):
    require("bitsandbytes")
    save_tiny_model(tmp_path, arch=arch, intermediate=192)  # bitsandbytes' CPU: K % 64
    kinds = {}
    for method in ("qerl", "lora", "qlora", "full"):
        policy = build_policy(method, tmp_path)
        q_proj = policy.base_model.model.layers[0].self_attn.q_proj
        base = q_proj.get_base_layer() if hasattr(q_proj, "get_base_layer") else q_proj
        kinds[method] = type(base).__name__
        assert logits(policy).isfinite().all()
        trainable = policy.trainable_parameters()
        if method == "full":
            assert len(trainable) == len(list(policy.model.parameters()))
        else:  # only LoRA: 2 matrices x 7 projections x 2 layers
            assert len(trainable) == 28 and all("lora_" in n for n in trainable)
    assert kinds == {"qerl": "NVFP4Linear", "lora": "Linear", "qlora": "Linear4bit",
                     "full": "Linear"}


def test_nvfp4_lora_equals_dequantized_bf16_lora(tiny_checkpoint, monkeypatch):
    """Same adapter, same (dequantized) base weights: on the torch reference path the NVFP4
    policy computes exactly what PEFT's BF16 LoRA does (the lora method on an NVFP4
    checkpoint dequantizes it)."""
    from qerl.nn import nvfp4_linear

    seed = fresh_seed()
    qerl = build_policy("qerl", tiny_checkpoint)
    bf16 = build_policy("lora", tiny_checkpoint)
    randomize_adapter(qerl, seed)
    randomize_adapter(bf16, seed)
    monkeypatch.setattr(nvfp4_linear, "_use_kernels", lambda x: False)
    assert torch.equal(logits(qerl), logits(bf16)), f"seed {seed}"


@pytest.mark.parametrize("shape", [(1, 64), (3, 11, 64)])
def test_kernel_lora_layer_matches_the_bf16_lora_layer(tiny_checkpoint, shape):
    """The fused-kernel path (GPU, or Triton's interpreter) of one NVFP4 LoRA layer against
    PEFT's BF16 layer over the dequantized weight: equal to bf16 rounding (the kernels do
    not round the weight to bf16 before multiplying, so they are not bit-identical). The
    bound allows both sides' roundings (weights and output, up to 2^-9 each) on as few as 64
    outputs, where one cancelling sum can dominate: 8.6e-3 was seen once (seed
    2121502452); a wrong layout or scale gives errors of order 1."""
    seed = fresh_seed()
    qerl = build_policy("qerl", tiny_checkpoint)
    bf16 = build_policy("lora", tiny_checkpoint)
    randomize_adapter(qerl, seed)
    randomize_adapter(bf16, seed)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    for layer in ("self_attn.q_proj", "mlp.up_proj"):
        got = qerl.base_model.model.layers[1].get_submodule(layer)(x)
        ref = bf16.base_model.model.layers[1].get_submodule(layer)(x)
        assert rel(got.float(), ref.float()) < 1.6e-2, f"seed {seed}, {layer}"


def test_a_cpu_policy_computes_the_checkpoint_in_fp32(tiny_checkpoint, reference_kernels):
    """Where no kernel runs (a CPU), the dense weights are fp32 holding the checkpoint's
    BF16 values and each NVFP4 layer multiplies by its weight decoded in fp32: the logits
    are transformers' own model in float64 over the checkpoint's weights, decoded by the
    specification, to fp32 rounding (two layers of hidden 64, fp32 sums)."""
    from transformers import AutoConfig

    policy = build_policy("qerl", tiny_checkpoint)
    floats = [p for p in policy.model.parameters() if p.is_floating_point()]
    assert floats and all(p.dtype == torch.float32 for p in floats)
    stored = load_file(tiny_checkpoint / "model.safetensors")
    weights = {name: t.double() for name, t in stored.items() if t.is_floating_point()
               and not name.rsplit(".", 1)[1].startswith("weight_")}
    for name in {n.rsplit(".", 1)[0] for n in stored if n.endswith(".weight_packed")}:
        weights[f"{name}.weight"] = spec_weight(*(stored[f"{name}.weight_{part}"] for part in
                                                  ("packed", "scale", "global_scale")))
    config = AutoConfig.from_pretrained(tiny_checkpoint)
    del config.quantization_config
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    reference.load_state_dict(weights)  # strict: every tensor of the model given
    with torch.no_grad():
        want = reference(IDS).logits
    got = logits(policy).double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_qerl_from_bf16_source_quantizes_as_the_checkpoint_does(tiny_model_dir,
                                                                  tiny_checkpoint):
    a = build_policy("qerl", tiny_model_dir).base_model
    b = build_policy("qerl", tiny_checkpoint).base_model
    layers_a = {n: m for n, m in a.named_modules() if isinstance(m, NVFP4Linear)}
    layers_b = {n: m for n, m in b.named_modules() if isinstance(m, NVFP4Linear)}
    assert layers_a.keys() == layers_b.keys() and len(layers_a) == 14
    for name, layer in layers_a.items():
        for buf in ("weight_pairs", "weight_scale", "weight_global_scale"):
            assert torch.equal(getattr(layer, buf), getattr(layers_b[name], buf)), name


@pytest.mark.parametrize("train_norms", [False, True])
def test_gradients_reach_only_lora_and_norms_when_asked(tiny_checkpoint, train_norms):
    policy = build_policy("qerl", tiny_checkpoint, lora=LoraSettings(train_norms=train_norms))
    randomize_adapter(policy, fresh_seed())
    policy.model(IDS).logits.float().square().mean().backward()
    with_grad = {n for n, p in policy.model.named_parameters() if p.grad is not None}
    lora = {n for n in with_grad if "lora_" in n}
    norms = with_grad - lora
    assert len(lora) == 28
    assert all(n.endswith("norm.weight") for n in norms)
    assert len(norms) == (5 if train_norms else 0)  # 2 x 2 layer norms + the final norm
    assert not any(b.requires_grad for b in policy.model.buffers())


@pytest.mark.parametrize("train_norms", [False, True])
def test_adapter_round_trip_reproduces_logits(tiny_checkpoint, tmp_path, train_norms):
    seed = fresh_seed()
    lora = LoraSettings(rank=8, alpha=16, train_norms=train_norms)
    policy = build_policy("qerl", tiny_checkpoint, lora=lora)
    randomize_adapter(policy, seed)
    if train_norms:
        with torch.no_grad():
            for w in policy.norm_weights().values():
                w.mul_(1.1)
    expected = logits(policy)
    policy.save_adapter(tmp_path / "adapter")
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert ("norms.safetensors" in files) == train_norms
    fresh = load_adapter(build_policy("qerl", tiny_checkpoint, lora=lora), tmp_path / "adapter")
    assert torch.equal(logits(fresh), expected), f"seed {seed}"


def test_adapter_is_standard_peft_and_loads_on_the_bf16_base(tiny_model_dir, tmp_path):
    seed = fresh_seed()
    policy = build_policy("qerl", tiny_model_dir)
    randomize_adapter(policy, seed)
    policy.save_adapter(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(LoraSettings().target_modules)
    keys = load_file(tmp_path / "adapter_model.safetensors")
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
    assert not any("base_layer" in k for k in keys)
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    peft = PeftModel.from_pretrained(bf16, tmp_path)
    # The base's projections given the quantized weights' values: the same adapter on the
    # same weights gives the same logits, to 16-bit rounding (~1-2% through this tiny random
    # model; without the adapter 30-140%). Against the unquantized base they would differ
    # by NVFP4's error, which here varies with the seed.
    quantized = {n: m for n, m in policy.model.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(quantized) == 14
    with torch.no_grad():
        for name, layer in quantized.items():
            peft.get_submodule(name).weight.copy_(layer.dequantized_weight(torch.bfloat16))
        on_bf16 = peft(IDS).logits.float()
    assert rel(logits(policy), on_bf16) < 0.1, f"seed {seed}"


def test_random_architecture_and_gguf_sources(monkeypatch):
    smollm2 = require_smollm2()
    from qerl.nn import nvfp4_linear

    monkeypatch.setattr(nvfp4_linear, "_use_kernels", lambda x: False)  # 30 layers: reference
    policy = build_policy("qerl", smollm2, lora=LoraSettings(rank=4))
    assert policy.config.model_type == "llama"
    assert sum(isinstance(m, NVFP4Linear) for m in policy.base_model.modules()) == 30 * 7
    assert policy.model(IDS).logits.isfinite().all()


def test_aqn_is_attached_to_the_policy(tiny_checkpoint):
    policy = build_policy("qerl", tiny_checkpoint, aqn=AQNSettings(num_stages=3),
                          total_steps=9)
    assert len(policy.aqn.weights) == 4
    clean = logits(policy)
    assert policy.aqn.perturb(step=5) > 0
    assert not torch.equal(logits(policy), clean)  # the policy's own forward sees it
    policy.aqn.restore()
    assert torch.equal(logits(policy), clean)


def test_bad_requests_are_named(tiny_checkpoint, tmp_path):
    with pytest.raises(PolicyError, match="unknown method 'dora'"):
        build_policy("dora", tiny_checkpoint)
    with pytest.raises(PolicyError, match=r"target module\(s\) \['c_attn'\] match nothing"):
        build_policy("qerl", tiny_checkpoint, lora=LoraSettings(target_modules=("c_attn",)))
    with pytest.raises(ValidationError, match="LoraSettings\nrank\n  Input should be greater"):
        LoraSettings(rank=0)
    with pytest.raises(ValidationError, match="target_modules\n .* at least 1 item"):
        LoraSettings(target_modules=())
    with pytest.raises(ValidationError, match="sigma_end <= sigma_start"):
        AQNSettings(sigma_start=1e-4, sigma_end=1e-2)
    with pytest.raises(PolicyError, match="needs total_steps"):
        build_policy("qerl", tiny_checkpoint, aqn=AQNSettings())
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path / "gpt2")
    with pytest.raises(ArchitectureError, match="'gpt2' is not supported"):
        build_policy("lora", tmp_path / "gpt2")
    require("bitsandbytes")
    with pytest.raises(PolicyError, match="needs in_features % 64 == 0; .*down_proj has 160"):
        build_policy("qlora", tiny_checkpoint)
    with pytest.raises(PolicyError, match="method 'full' has no adapter"):
        build_policy("full", tiny_checkpoint).save_adapter(tmp_path / "x")


SAVE = """
import sys, torch
from qerl.policy import build_policy, load_adapter
torch.manual_seed(0)
policy = build_policy("lora", sys.argv[1])
policy.save_adapter(sys.argv[2])
load_adapter(policy, sys.argv[2])
policy.save_adapter(sys.argv[3])
"""


def test_the_same_adapter_saves_the_same_bytes_in_any_process(tiny_model_dir, tmp_path):
    """PEFT's set of target modules is saved in the process's hash order; ours sorted, so
    reruns (another PYTHONHASHSEED) write byte-identical adapter files, loaded ones too."""
    for seed in ("1", "2"):
        run_python(["-c", SAVE, str(tiny_model_dir), str(tmp_path / seed / "built"),
                    str(tmp_path / seed / "loaded")], seed)
    first = tree_digests(tmp_path / "1")
    assert first == tree_digests(tmp_path / "2")
    assert first["built/adapter_config.json"] == first["loaded/adapter_config.json"]
