"""NVFP4Linear: the kernel path (CUDA, or Triton's interpreter) and the torch reference
agree, gradients reach the input and never the frozen weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qerl.formats import nvfp4
from qerl.formats.nvfp4_checkpoint import load_checkpoint
from qerl.kernels import device_facts as facts
from qerl.nn import NVFP4Linear, nvfp4_linear
from tests.conftest import fresh_seed, spec_weight


@pytest.mark.skipif(not (torch.cuda.is_available() or facts.interpreting()),
                    reason="no GPU and no Triton interpreter")
def test_kernel_and_reference_paths_agree_forward_and_backward(monkeypatch):
    seed = fresh_seed()
    torch.manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = NVFP4Linear.from_linear(nn.Linear(96, 48, bias=True)).to(dev)
    x = torch.randn(3, 5, 96, dtype=torch.bfloat16, device=dev, requires_grad=True)

    def run(use_kernels: bool):
        monkeypatch.setattr(nvfp4_linear, "_use_kernels", lambda x: use_kernels)
        x.grad = None
        y = layer(x)
        y.float().square().sum().backward()
        return y.detach().double(), x.grad.double()

    (y1, g1), (y2, g2) = run(True), run(False)
    assert (y1 - y2).norm() / y2.norm() < 1e-2, f"seed {seed}"
    assert (g1 - g2).norm() / g2.norm() < 1e-2, f"seed {seed}"
    assert all(not b.requires_grad for b in layer.buffers())
    assert not layer.bias.requires_grad


def test_trainable_bias_gets_its_gradient():
    layer = NVFP4Linear.from_linear(nn.Linear(32, 16))
    layer.bias.requires_grad_(True)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    layer(x).sum().backward()
    assert torch.allclose(layer.bias.grad.float(), torch.full((16,), 4.0))


def test_from_checkpoint_matches_the_quantizer(tiny_model_dir, tiny_checkpoint):
    from safetensors.torch import load_file

    ckpt = load_checkpoint(tiny_checkpoint)
    name = "model.layers.1.self_attn.q_proj"
    layer = NVFP4Linear.from_checkpoint(ckpt, name)
    src = load_file(tiny_model_dir / "model.safetensors")
    assert layer.bias is not None and torch.equal(layer.bias, src[f"{name}.bias"])
    assert torch.equal(layer.dequantized_weight(), nvfp4.dequantize(ckpt.quantized[name]))
    assert "format=nvfp4" in repr(layer)


# ---- the CPU path: the dense matmul over a weight decoded once -----------------------------

def spec_of(layer: NVFP4Linear) -> torch.Tensor:
    t = layer.packed_weight
    return spec_weight(t.packed, t.scale, t.global_scale)


@pytest.fixture
def cpu_layer(reference_kernels):
    seed = fresh_seed()
    torch.manual_seed(seed)
    return NVFP4Linear.from_linear(nn.Linear(96, 48, bias=True)), seed


def test_the_cpu_path_matches_float64_and_decodes_once(cpu_layer, monkeypatch):
    """fp32 activations (a CPU policy's) against the float64 product with the weight decoded
    by the specification: equal to fp32 rounding (the decoded weight is within two fp32
    roundings of exact, the sum over 96 products in fp32). Three calls decode once."""
    layer, seed = cpu_layer
    decodes = []
    real = nvfp4.dequantize
    monkeypatch.setattr(nvfp4, "dequantize", lambda *a: decodes.append(a) or real(*a))
    x = torch.randn(3, 5, 96, requires_grad=True)
    w64 = spec_of(layer)
    ref = x.double() @ w64.T + layer.bias.double()
    for _ in range(3):
        y = layer(x)
    assert len(decodes) == 1
    assert (y.double() - ref).abs().max() <= 1e-6 * ref.abs().max(), f"seed {seed}"
    dy = torch.randn_like(y)
    y.backward(dy)
    assert (x.grad.double() - dy.double() @ w64).abs().max() <= 1e-6 * x.grad.abs().max()
    assert all(not b.requires_grad for b in layer.buffers())


def test_the_decoded_weight_follows_every_change_of_the_codes(cpu_layer):
    """Whatever replaces or rewrites the codes and scales — in place, by load_state_dict, by
    assigning a new buffer, a new dtype of x — the next call multiplies by the new weight."""
    layer, seed = cpu_layer
    other = NVFP4Linear.from_linear(nn.Linear(96, 48, bias=True))
    x = torch.randn(4, 96)

    def expect(dtype=torch.float32):
        w = spec_of(layer)
        ref = x.double() @ w.T + layer.bias.double()
        got = layer(x.to(dtype)).double()
        assert (got - ref).abs().max() <= (1e-6 if dtype == torch.float32 else 2e-2) * \
            ref.abs().max(), f"seed {seed}"

    expect()
    with torch.no_grad():
        layer.weight_pairs.copy_(other.weight_pairs)  # codes rewritten in place
    expect()
    with torch.no_grad():
        layer.weight_scale.copy_(other.weight_scale)
    expect()
    with torch.no_grad():
        layer.weight_global_scale.mul_(2)
    expect()
    layer.load_state_dict(NVFP4Linear.from_linear(nn.Linear(96, 48)).state_dict(),
                          strict=False)
    expect()
    layer.weight_pairs = other.weight_pairs.clone()  # a new buffer
    expect()
    expect(torch.bfloat16)  # bf16: the weight and the output rounded to bf16
    expect()


def test_inference_tensors_are_decoded_at_every_call(reference_kernels):
    """Codes made under inference_mode keep no version counter: no copy is kept, and a
    rewrite is still seen."""
    with torch.inference_mode():
        layer = NVFP4Linear.from_linear(nn.Linear(32, 16, bias=False))
        x = torch.randn(2, 32)
        first = layer(x)
        layer.weight_global_scale.mul_(2)
        assert torch.allclose(layer(x), first / 2, rtol=1e-6)
    assert layer._decoded is None
