"""The fused NVFP4 kernels against a float64 reference: under Triton's CPU interpreter on
small odd shapes (so CI runs them), and on a GPU at real shapes (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from qerl.errors import QuantizationError
from qerl.formats import nvfp4
from qerl.kernels import device_facts as facts
from qerl.kernels import nvfp4_layout as layout
from qerl.kernels import nvfp4_matmul as km
from qerl.kernels import nvfp4_triton as fused_kernels
from tests.conftest import fresh_seed
from tests.kernels.conftest import device

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() or facts.interpreting()), reason="no GPU and no interpreter")


def make(n: int, k: int, m_shape: tuple, dtype, seed: int, dev: str):
    """A quantized weight (q, and the kernels' (pairs, scale, global_scale)), activations,
    a bias and an output gradient."""
    gen = torch.Generator().manual_seed(seed)
    q = nvfp4.quantize(torch.randn(n, k, generator=gen) * 0.05).to(dev)
    x = torch.randn(*m_shape, k, generator=gen).to(dtype).to(dev)
    bias = torch.randn(n, generator=gen).to(dtype).to(dev)
    dy = torch.randn(*m_shape, n, generator=gen).to(dtype).to(dev)
    return q, (layout.to_pairs(q.packed), q.scale, q.global_scale), x, bias, dy


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not got.isnan().any(), "NaN in the output: an element was never written"
    return ((got.double() - ref).norm() / ref.norm()).item()


# Odd shapes: M not a multiple of the tile, N and K multiples of 16 but not of the blocks,
# odd group counts (K % 32 == 16: the padded half chunk); M both under (fused kernels) and
# over (dequantize + matmul) FUSED_MAX_M.
SHAPES = [((1,), 48, 64), ((3,), 80, 96), ((2, 5), 40, 272), ((17,), 144, 48),
          ((33,), 24, 208), ((65,), 40, 80), ((3, 45), 72, 160)]


@needs_kernels
@pytest.mark.parametrize(("m_shape", "n", "k"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_and_input_grad_match_float64(poisoned, m_shape, n, k, dtype):
    seed = fresh_seed()
    q, w4, x, bias, dy = make(n, k, m_shape, dtype, seed, device())
    w = nvfp4.dequantize(q, torch.float64)
    y = km.nvfp4_linear(x, *w4, bias)
    assert y.shape == (*m_shape, n) and y.dtype == dtype
    # bf16 output rounding alone is ~2e-3 relative; fp16 ~3e-4.
    tol = 8e-3 if dtype == torch.bfloat16 else 1.5e-3
    assert rel_err(y, x.double() @ w.T + bias.double()) < tol, f"seed {seed}"
    dx = km.nvfp4_linear_grad_input(dy, *w4)
    assert dx.shape == (*m_shape, k)
    assert rel_err(dx, dy.double() @ w) < tol, f"seed {seed}"


# Triton's interpreter converts fp32 to bf16 by truncation (seen: 0.010193 -> 0.010132):
# bf16 bit-exactness is checked on a GPU only.
BF16_ROUNDS = pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="the interpreter truncates fp32 -> bf16")


@needs_kernels
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=BF16_ROUNDS),
                                   torch.float16, torch.float32])
def test_dequantize_kernel_is_bit_exact(poisoned, dtype):
    seed = fresh_seed()
    q, w4, _, _, _ = make(40, 208, (1,), torch.float16, seed, device())
    assert torch.equal(fused_kernels.dequantize(*w4, dtype),
                       nvfp4.dequantize(q, dtype)), f"seed {seed}"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_kernels_return_each_weight_to_half_an_ulp(poisoned, dtype):
    """With one-hot rows (exact inputs) each output is one weight: the fused kernels
    multiply exact products by 1 / global_scale once, so the result is the float64 weight
    correctly rounded, or one ulp off where that product rounds across a tie."""
    seed = fresh_seed()
    q, w4, _, _, _ = make(24, 80, (1,), dtype, seed, device())
    w = nvfp4.dequantize(q, torch.float64)
    cols = km.nvfp4_linear(torch.eye(80, dtype=dtype, device=device()), *w4)  # [K, N]
    rows = km.nvfp4_linear_grad_input(torch.eye(24, dtype=dtype, device=device()), *w4)
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    for got in (cols.T, rows):
        err = (got.double() - w).abs() / w.abs().clamp_min(1e-30)
        assert (err <= ulp).all(), f"seed {seed}: {err.max().item()}"


@needs_kernels
def test_bad_inputs_are_named():
    _, (pairs, scale, gs), x, bias, _ = make(32, 64, (4,), torch.bfloat16, 0, device())
    with pytest.raises(QuantizationError, match="bfloat16 or float16"):
        km.nvfp4_linear(x.float(), pairs, scale, gs)
    with pytest.raises(QuantizationError, match="last dim 48; .* needs 64"):
        km.nvfp4_linear(x[:, :48], pairs, scale, gs)
    with pytest.raises(QuantizationError, match="bias must have shape"):
        km.nvfp4_linear(x, pairs, scale, gs, bias[:5])
    with pytest.raises(QuantizationError, match=r"\[16, 64\] weight need tiles of shape"):
        km.nvfp4_linear(x, pairs, scale[:16], gs)
    with pytest.raises(QuantizationError, match="weight_scale must be float8_e4m3fn"):
        km.nvfp4_linear(x, pairs, scale.float(), gs)
    with pytest.raises(QuantizationError, match="weight_global_scale must be one float32"):
        km.nvfp4_linear(x, pairs, scale, gs.repeat(2))
    # Non-contiguous activations are handled, not refused.
    xt = torch.randn(64, 4, dtype=torch.bfloat16, device=device()).T
    ref = km.reference_linear(xt.contiguous(), pairs, scale, gs)
    assert torch.allclose(km.nvfp4_linear(xt, pairs, scale, gs), ref, rtol=2e-2, atol=1e-2)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_named_path_runs_where_the_automatic_choice_would_not(poisoned, dtype):
    """Benchmarks time one path against another at the same M: each named path gives the
    float64 result there too."""
    seed = fresh_seed()
    q, w4, x, bias, dy = make(40, 272, (5,), dtype, seed, device())
    w = nvfp4.dequantize(q, torch.float64)
    tol = 8e-3 if dtype == torch.bfloat16 else 1.5e-3
    runs = {"cuda": km.cuda_runs(x), "gemm": km.gemm_runs(x, w4[1], w4[0])}
    forward = [p for p in km.FORWARD_PATHS if runs.get(p, True)]
    assert {"triton", "dequant"} <= set(forward)
    for path in forward:
        y = km.nvfp4_linear(x, *w4, bias, path=path)
        assert rel_err(y, x.double() @ w.T + bias.double()) < tol, f"{path}, seed {seed}"
    for path in km.GRAD_INPUT_PATHS:
        dx = km.nvfp4_linear_grad_input(dy, *w4, path=path)
        assert rel_err(dx, dy.double() @ w) < tol, f"{path}, seed {seed}"


@needs_kernels
def test_paths_are_chosen_by_m_and_bad_names_refused():
    _, w4, x, _, dy = make(32, 64, (40,), torch.bfloat16, 0, device())
    assert km.forward_path(x, *w4[:2]) == "dequant" and km.grad_input_path(dy) == "dequant"
    assert km.forward_path(x[:km.FUSED_MAX_M], *w4[:2]) in ("cuda", "triton")
    assert km.grad_input_path(dy[:km.FUSED_MAX_M]) == "triton"
    with pytest.raises(QuantizationError, match="unknown path 'fast'; choose one of cuda"):
        km.nvfp4_linear(x, *w4, path="fast")
    with pytest.raises(QuantizationError, match="unknown path 'cuda'; choose one of triton"):
        km.nvfp4_linear_grad_input(dy, *w4, path="cuda")
    with pytest.raises(QuantizationError, match="the CUDA kernel runs 1 to 32 rows"):
        km.nvfp4_linear(x, *w4, path="cuda")  # 40 rows


@pytest.mark.skipif(torch.cuda.is_available() or facts.interpreting(),
                    reason="checks a CPU-only machine without the interpreter")
def test_cpu_tensors_without_interpreter_point_to_the_reference():
    _, w4, x, _, _ = make(32, 64, (4,), torch.bfloat16, 0, "cpu")
    with pytest.raises(QuantizationError, match="need CUDA tensors"):
        km.nvfp4_linear(x, *w4)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("m", [1, 7, 16, 32, 64, 300, 2048])
@pytest.mark.parametrize(("n", "k"), [(37888, 3584), (3584, 18944), (4608, 3584), (200, 208)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_shapes_on_gpu(poisoned, m, n, k, dtype):
    """The path chosen by M, and the fused Triton kernels also where they are named beyond
    their crossover (a benchmark's baseline, or the fallback where the CUDA kernel does not
    build)."""
    seed = fresh_seed()
    q, w4, x, bias, dy = make(n, k, (m,), dtype, seed, "cuda")
    w = nvfp4.dequantize(q, torch.float64)
    tol = 8e-3 if dtype == torch.bfloat16 else 1.5e-3
    for path in (None, "triton") if m <= 64 else (None,):
        y = km.nvfp4_linear(x, *w4, bias, path=path)
        assert rel_err(y, x.double() @ w.T + bias.double()) < tol, f"{path}, seed {seed}"
        dx = km.nvfp4_linear_grad_input(dy, *w4, path=path)
        assert rel_err(dx, dy.double() @ w) < tol, f"{path}, seed {seed}"
