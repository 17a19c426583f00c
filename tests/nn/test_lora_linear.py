"""Our LoRA Linear: under autocast it adds the adapter inside the GEMM, and matches a float64
reference at least as closely as PEFT's own forward (forward and gradients); anywhere else
it is PEFT's forward, bit for bit."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

from qerl.nn import NVFP4Linear
from qerl.nn.lora_linear import LoraLinear
from qerl.nn.nvfp4_lora import register_lora_layers
from tests.conftest import fresh_seed


class Block(nn.Module):
    def __init__(self, base: nn.Module):
        super().__init__()
        self.proj = base

    def forward(self, x):
        return self.proj(x)


def lora_block(seed: int, n_in=48, n_out=40, rank=8, bias=True, nvfp4=False):
    torch.manual_seed(seed)
    dense = nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16)
    base = NVFP4Linear.from_linear(dense) if nvfp4 else dense
    config = register_lora_layers(LoraConfig(r=rank, lora_alpha=2 * rank,
                                             target_modules=["proj"]), nvfp4)
    model = get_peft_model(Block(base), config)
    layer = model.base_model.model.proj
    nn.init.normal_(layer.lora_B["default"].weight, std=0.2)  # PEFT starts B at zero
    return model, layer


def reference(layer, x):
    """y = x W^T + b + s (x A^T) B^T in float64, W as the base computes with it."""
    base = layer.base_layer
    w = (base.dequantized_weight() if isinstance(base, NVFP4Linear) else base.weight).double()
    a = layer.lora_A["default"].weight.detach().double()
    b = layer.lora_B["default"].weight.detach().double()
    x = x.double()
    y = x @ w.T + layer.scaling["default"] * (x @ a.T) @ b.T
    return y if base.bias is None else y + base.bias.double()


def run(layer, x, forward, autocast=True):
    x = x.detach().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = forward(x)
    y.float().sum().backward()
    return (y.detach().double(), x.grad.double(), layer.lora_A["default"].weight.grad.double(),
            layer.lora_B["default"].weight.grad.double())


def err(got, ref):
    return ((got - ref).norm() / ref.norm()).item()


# 40 rows: past the NVFP4 kernels' small-M path, whose output is a view (added out of place).
@pytest.mark.parametrize("nvfp4", [False, True])
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 48), (40, 48)])
def test_autocast_fast_path_is_as_close_to_float64_as_peft(nvfp4, shape):
    seed = fresh_seed()
    _, layer = lora_block(seed, nvfp4=nvfp4)
    assert type(layer) is not PeftLoraLinear and isinstance(layer, LoraLinear)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    ours = run(layer, x, layer)
    peft = run(layer, x, lambda x: PeftLoraLinear.forward(layer, x))
    assert ours[0].dtype == peft[0].dtype and ours[0].shape == peft[0].shape
    # Gradients in float64: d(sum y)/dx = 1 W + s 1 B A; dA = s B^T 1 x; dB = s 1 (x A^T).
    xd = x.double()
    ones = torch.ones(*shape[:-1], 40, dtype=torch.float64)
    a = layer.lora_A["default"].weight.detach().double()
    b = layer.lora_B["default"].weight.detach().double()
    base = layer.base_layer
    w = (base.dequantized_weight() if nvfp4 else base.weight).double()
    s = layer.scaling["default"]
    flat, xflat = ones.reshape(-1, 40), xd.reshape(-1, 48)
    refs = (reference(layer, x), (ones @ w + s * ones @ b @ a),
            s * (flat @ b).T @ xflat, s * flat.T @ (xflat @ a.T))
    for what, got, theirs, ref in zip(("y", "dx", "dA", "dB"), ours, peft, refs, strict=True):
        # bf16 operands (x, the adapters cast by autocast) bound both; ours rounds the sum once.
        assert err(got, ref) <= max(1.05 * err(theirs, ref), 4e-3), f"seed {seed}, {what}"


def test_without_autocast_it_is_pefts_forward_bit_for_bit():
    seed = fresh_seed()
    _, layer = lora_block(seed)
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    ours = run(layer, x, layer, autocast=False)
    peft = run(layer, x, lambda x: PeftLoraLinear.forward(layer, x), autocast=False)
    for got, ref in zip(ours, peft, strict=True):
        assert torch.equal(got, ref), f"seed {seed}"


def test_disabled_adapter_and_two_adapters_take_pefts_path():
    seed = fresh_seed()
    model, layer = lora_block(seed)
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        with model.disable_adapter():
            assert torch.equal(layer(x), layer.base_layer(x))
        model.add_adapter("other", LoraConfig(r=4, target_modules=["proj"]))
        nn.init.normal_(layer.lora_B["other"].weight)
        layer.set_adapter(["default", "other"])
        assert torch.equal(layer(x), PeftLoraLinear.forward(layer, x))


def test_fast_path_trains_under_gradient_checkpointing():
    """The in-place add on the base output survives a checkpointed recompute: the same
    gradients as without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    seed = fresh_seed()
    _, layer = lora_block(seed)
    x = torch.randn(2, 6, 48, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    plain = run(layer, x, layer)
    ckpt = run(layer, x, lambda x: checkpoint(layer, x, use_reentrant=False))
    for got, ref in zip(plain, ckpt, strict=True):
        assert torch.equal(got, ref), f"seed {seed}"
