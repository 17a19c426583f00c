"""Liger's fused norm and SwiGLU: bound to every RMSNorm and MLP, taken only under autocast
on CUDA (where they match the modules' own forward and gradients to bf16 rounding), and
nowhere else: on CPU the model computes exactly what it did."""

from __future__ import annotations

import pytest
import torch

from qerl.nn import liger as liger_module
from qerl.nn.liger import use_liger
from qerl.noise import AdaptiveQuantizationNoise, AQNSettings
from qerl.settings import ConfigError
from tests.conftest import fresh_seed, tiny_config


def tiny_model(seed: int, device="cpu"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.bfloat16).to(device)


def test_binds_every_norm_and_mlp_and_changes_nothing_off_the_gpu():
    seed = fresh_seed()
    model, plain = tiny_model(seed), tiny_model(seed)
    layers = model.config.num_hidden_layers
    assert use_liger(model) == 3 * layers + 1  # two norms and an MLP a layer, the final norm
    ids = torch.randint(0, model.config.vocab_size, (2, 9),
                        generator=torch.Generator().manual_seed(seed))
    for autocast in (False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            assert torch.equal(model(ids).logits, plain(ids).logits), f"seed {seed}"


def test_a_missing_liger_kernel_is_named_with_its_fix(monkeypatch):
    liger_module.require_liger()  # installed here
    monkeypatch.setattr(liger_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install 'liger-kernel>=0.6'.*train.liger: false"):
        liger_module.require_liger()


def grads(module, x, upstream):
    x = x.detach().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = module(x)
    # A random upstream gradient: one made from y (say, of y^2) nearly cancels in a norm's
    # backward, where the roundings of the module's own bf16 steps then dominate.
    y.backward(upstream.to(y.dtype))
    return y.detach(), x.grad


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's kernels need a GPU")
@pytest.mark.parametrize("aqn", [False, True])
def test_on_gpu_under_autocast_the_fused_ops_match_the_modules(aqn):
    seed = fresh_seed()
    models = []
    for liger in (True, False):
        model = tiny_model(seed, "cuda")
        if aqn:  # AQN keeps the norm weights in fp32, the output cast back by a hook
            AdaptiveQuantizationNoise(model, AQNSettings(num_stages=2), total_steps=2).perturb(1)
        if liger:
            use_liger(model)
        models.append(model.model.layers[0])
    x = torch.randn(3, 17, models[0].hidden_size, device="cuda",
                    generator=torch.Generator("cuda").manual_seed(seed)).to(torch.bfloat16)
    upstream = torch.randn(x.shape, device="cuda",
                           generator=torch.Generator("cuda").manual_seed(seed + 1))
    for name in ("input_layernorm", "mlp"):
        fused, own = (grads(layer.get_submodule(name), x, upstream) for layer in models)
        for got, ref in zip(fused, own, strict=True):
            assert got.dtype == ref.dtype and rel(got, ref) < 1e-2, f"seed {seed}, {name}"
