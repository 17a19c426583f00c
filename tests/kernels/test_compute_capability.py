"""QERL_KERNEL_ARCH: the kernels chosen as on an older card. On the CPU: the variable read,
the route it changes (a GPU's facts stood in for), and the scales read from their bits as
a card before sm_89 reads them (Triton's interpreter) against float64. On a GPU (marked):
the paths an RTX 4090 (sm_89) or an A100 (sm_80) takes, at real shapes, against float64."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from qerl.errors import QuantizationError
from qerl.formats import nvfp4
from qerl.kernels import compute_capability as cc
from qerl.kernels import nvfp4_gemv as gemv
from qerl.kernels import nvfp4_layout as layout
from qerl.kernels import nvfp4_matmul as km
from qerl.kernels import nvfp4_triton as fused_kernels
from tests.conftest import fresh_seed
from tests.kernels.conftest import device
from tests.kernels.test_nvfp4_matmul import make, needs_kernels, rel_err


@pytest.mark.parametrize(("value", "arch"), [("sm_89", 89), ("89", 89), ("8.0", 80),
                                             ("sm86", 86), ("sm_100", 100), ("10.0", 100),
                                             ("", None)])
def test_the_variable_names_a_compute_capability(monkeypatch, value, arch):
    monkeypatch.setenv(cc.VARIABLE, value)
    assert cc.named() == arch


def test_a_bad_or_newer_architecture_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for bad in ("ampere", "sm_8", "9.0.1"):
        monkeypatch.setenv(cc.VARIABLE, bad)
        with pytest.raises(QuantizationError, match="QERL_KERNEL_ARCH takes a compute "
                                                    "capability"):
            cc.named()
    monkeypatch.setenv(cc.VARIABLE, "sm_100")
    with pytest.raises(QuantizationError, match="sm_100 names a newer architecture than "
                                                "cuda:0's sm_90"):
        cc.chosen_for(torch.device("cuda", 0))


@pytest.mark.parametrize(("arch", "decode", "prefill", "fp8"), [
    ("", "cuda", "gemm", True),  # the card's own: the Hopper GEMM past 32 rows
    ("sm_89", "cuda", "dequant", True),  # RTX 4090: no wgmma
    ("sm_80", "cuda", "dequant", False),  # A100: no fp8 conversion either
    ("sm_75", "triton", "dequant", False)])  # no bf16 mma: not the CUDA kernel
def test_the_switch_makes_an_older_cards_choice(hopper, monkeypatch, arch, decode, prefill,
                                                fp8):
    monkeypatch.setenv(cc.VARIABLE, arch)
    n, k = 4608, 3584  # 7B's q/k/v: the H100's sweep has the GEMM win at 64 rows
    pairs = torch.zeros(n, k // 2, dtype=torch.uint8)
    scale = torch.ones(n, k // nvfp4.GROUP_SIZE, dtype=torch.float8_e4m3fn)
    with FakeTensorMode():  # activations on a GPU that is not there: only their shape is read
        rows8 = torch.empty(8, k, dtype=torch.bfloat16, device="cuda")
        rows64 = torch.empty(64, k, dtype=torch.bfloat16, device="cuda")
    assert km.forward_path(rows8, pairs, scale) == decode
    assert km.forward_path(rows64, pairs, scale) == prefill
    assert cc.converts_fp8(torch.device("cuda", 0)) is fp8


def weight_with_every_scale(n: int, k: int, seed: int):
    """Random E2M1 codes and block scales that take every finite E4M3 value (both signs,
    subnormals included), with the kernels' layout; the NVFP4 tensor."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    picks = finite[torch.randint(len(finite), (n, k // nvfp4.GROUP_SIZE), generator=gen)]
    picks.view(-1)[:len(finite)] = finite  # each value at least once
    q = nvfp4.NVFP4Tensor(packed, picks.view(torch.float8_e4m3fn),
                          torch.tensor([3.0], dtype=torch.float32))
    return q, (layout.to_pairs(packed), q.scale, q.global_scale)


@needs_kernels
@pytest.mark.parametrize("arch", ["", "sm_80"])
def test_the_scales_read_from_their_bits_equal_the_fp8_conversion(monkeypatch, arch):
    """An older card's kernels (no fp8 conversion) read every E4M3 scale as the reference
    does: the dequantize kernel bit for bit, the fused forward and input gradient to fp32
    accumulation against float64."""
    monkeypatch.setenv(cc.VARIABLE, arch)
    seed = fresh_seed()
    q, w4 = weight_with_every_scale(48, 256, seed)
    w4 = tuple(t.to(device()) for t in w4)
    assert torch.equal(fused_kernels.dequantize(*w4, torch.float32).cpu(),
                       nvfp4.dequantize(q, torch.float32)), f"seed {seed}"
    w = nvfp4.dequantize(q, torch.float64).to(device())
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 256, generator=gen).to(torch.float16).to(device())
    dy = torch.randn(5, 48, generator=gen).to(torch.float16).to(device())
    # fp16 output rounding (~3e-4 relative) on sums of products of very unequal size.
    assert rel_err(km.nvfp4_linear(x, *w4, path="triton"), x.double() @ w.T) < 1.5e-3
    assert rel_err(km.nvfp4_linear_grad_input(dy, *w4, path="triton"), dy.double() @ w) < 1.5e-3


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("arch", ["sm_89", "sm_86", "sm_80"])
@pytest.mark.parametrize("m", [1, 8, 32, 33, 300, 2048])
@pytest.mark.parametrize(("n", "k"), [(37888, 3584), (3584, 18944), (4608, 3584)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_older_cards_paths_at_real_shapes_on_a_gpu(monkeypatch, arch, m, n, k, dtype):
    """What an RTX 4090 (sm_89), 3090 (sm_86) or A100 (sm_80) runs, on this card: never the
    Hopper GEMM; the CUDA kernel (built for that architecture too; else the fused Triton
    kernel) up to 32 rows, the dequantize kernel and cuBLAS beyond; the fused Triton
    kernels for the input gradient and where named; every one against float64."""
    monkeypatch.setenv(cc.VARIABLE, arch)
    seed = fresh_seed()
    q, w4, x, bias, dy = make(n, k, (m,), dtype, seed, "cuda")
    w = nvfp4.dequantize(q, torch.float64)
    tol = 8e-3 if dtype == torch.bfloat16 else 1.5e-3
    small = "cuda" if gemv.available(x.device) else "triton"  # where nvcc builds it
    path = km.forward_path(x, *w4[:2])
    assert path == (small if m <= km.CUDA_MAX_M else "dequant"), path
    for named in (None, "triton") if m <= 64 else (None,):
        y = km.nvfp4_linear(x, *w4, bias, path=named)
        assert rel_err(y, x.double() @ w.T + bias.double()) < tol, f"{named}, seed {seed}"
        dx = km.nvfp4_linear_grad_input(dy, *w4, path=named)
        assert rel_err(dx, dy.double() @ w) < tol, f"{named}, seed {seed}"
