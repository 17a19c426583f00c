"""The fused NVFP4 kernels against a float64 reference: under Triton's CPU interpreter on
small odd shapes (so CI runs them), and on a GPU at real shapes (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from qerl.errors import QuantizationError
from qerl.formats import nvfp4
from qerl.kernels import nvfp4_matmul as km
from tests.conftest import fresh_seed

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() or km.interpreting()), reason="no GPU and no interpreter")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the kernels' wrappers allocate starts as NaN: unwritten output fails."""
    real_empty = torch.empty

    def empty(*shape, dtype=None, device=None, **kw):
        t = real_empty(*shape, dtype=dtype, device=device, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


def make(n: int, k: int, m_shape: tuple, dtype, seed: int, dev: str):
    gen = torch.Generator().manual_seed(seed)
    q = nvfp4.quantize(torch.randn(n, k, generator=gen) * 0.05).to(dev)
    x = torch.randn(*m_shape, k, generator=gen).to(dtype).to(dev)
    bias = torch.randn(n, generator=gen).to(dtype).to(dev)
    dy = torch.randn(*m_shape, n, generator=gen).to(dtype).to(dev)
    return q, x, bias, dy


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not got.isnan().any(), "NaN in the output: an element was never written"
    return ((got.double() - ref).norm() / ref.norm()).item()


# Odd shapes: M not a multiple of the tile, N and K multiples of 16 but not of the blocks;
# M both under (split-K path) and over (tiled path) the skinny threshold.
SHAPES = [((1,), 48, 64), ((3,), 80, 96), ((2, 5), 40, 272), ((17,), 144, 48),
          ((65,), 40, 80), ((3, 45), 72, 160)]


@needs_kernels
@pytest.mark.parametrize(("m_shape", "n", "k"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_and_input_grad_match_float64(poisoned, m_shape, n, k, dtype):
    seed = fresh_seed()
    q, x, bias, dy = make(n, k, m_shape, dtype, seed, device())
    w = nvfp4.dequantize(q, torch.float64)
    y = km.nvfp4_linear(x, q.packed, q.scale, q.global_scale, bias)
    assert y.shape == (*m_shape, n) and y.dtype == dtype
    # bf16 output rounding alone is ~2e-3 relative; fp16 ~3e-4.
    tol = 8e-3 if dtype == torch.bfloat16 else 1.5e-3
    assert rel_err(y, x.double() @ w.T + bias.double()) < tol, f"seed {seed}"
    dx = km.nvfp4_linear_grad_input(dy, q.packed, q.scale, q.global_scale)
    assert dx.shape == (*m_shape, k)
    assert rel_err(dx, dy.double() @ w) < tol, f"seed {seed}"


@needs_kernels
def test_dequantized_tile_is_bit_exact(poisoned):
    """With fp32-exact inputs (one-hot rows of x) the kernel returns W's columns exactly as
    the reference dequantizes them."""
    seed = fresh_seed()
    q, _, _, _ = make(32, 64, (1,), torch.float16, seed, device())
    eye = torch.eye(64, dtype=torch.float16, device=device())
    cols = km.nvfp4_linear(eye, q.packed, q.scale, q.global_scale)  # [K, N] = W^T
    assert torch.equal(cols.T, nvfp4.dequantize(q, torch.float16)), f"seed {seed}"


@needs_kernels
def test_bad_inputs_are_named():
    q, x, bias, _ = make(32, 64, (4,), torch.bfloat16, 0, device())
    with pytest.raises(QuantizationError, match="bfloat16 or float16"):
        km.nvfp4_linear(x.float(), q.packed, q.scale, q.global_scale)
    with pytest.raises(QuantizationError, match="last dim 48; .* needs 64"):
        km.nvfp4_linear(x[:, :48], q.packed, q.scale, q.global_scale)
    with pytest.raises(QuantizationError, match="bias must have shape"):
        km.nvfp4_linear(x, q.packed, q.scale, q.global_scale, bias[:5])
    with pytest.raises(QuantizationError, match="weight_scale must be"):
        km.nvfp4_linear(x, q.packed, q.scale[:, :1], q.global_scale)
    # Non-contiguous activations are handled, not refused.
    xt = torch.randn(64, 4, dtype=torch.bfloat16, device=device()).T
    ref = km.reference_linear(xt.contiguous(), q.packed, q.scale, q.global_scale)
    assert torch.allclose(km.nvfp4_linear(xt, q.packed, q.scale, q.global_scale), ref,
                          rtol=2e-2, atol=1e-2)


@pytest.mark.skipif(torch.cuda.is_available() or km.interpreting(),
                    reason="checks a CPU-only machine without the interpreter")
def test_cpu_tensors_without_interpreter_point_to_the_reference():
    q, x, _, _ = make(32, 64, (4,), torch.bfloat16, 0, "cpu")
    with pytest.raises(QuantizationError, match="need CUDA tensors"):
        km.nvfp4_linear(x, q.packed, q.scale, q.global_scale)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("m", [1, 7, 16, 64, 300, 2048])
@pytest.mark.parametrize(("n", "k"), [(37888, 3584), (3584, 18944), (4608, 3584)])
def test_real_shapes_on_gpu(poisoned, m, n, k):
    seed = fresh_seed()
    q, x, bias, dy = make(n, k, (m,), torch.bfloat16, seed, "cuda")
    w = nvfp4.dequantize(q, torch.float64)
    y = km.nvfp4_linear(x, q.packed, q.scale, q.global_scale, bias)
    assert rel_err(y, x.double() @ w.T + bias.double()) < 8e-3, f"seed {seed}"
    dx = km.nvfp4_linear_grad_input(dy, q.packed, q.scale, q.global_scale)
    assert rel_err(dx, dy.double() @ w) < 8e-3, f"seed {seed}"
