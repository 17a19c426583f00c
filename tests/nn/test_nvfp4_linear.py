"""NVFP4Linear: the kernel path (CUDA, or Triton's interpreter) and the torch reference
agree, gradients reach the input and never the frozen weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qerl.checkpoint import load_checkpoint
from qerl.formats import nvfp4
from qerl.kernels import nvfp4_matmul as km
from qerl.nn import NVFP4Linear, nvfp4_linear
from tests.conftest import fresh_seed


@pytest.mark.skipif(not (torch.cuda.is_available() or km.interpreting()),
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
