"""NVFP4 math: hand-worked values, a float64 reference, and bit-exactness against
compressed-tensors' own quantize/pack (the code llmcompressor runs)."""

from __future__ import annotations

import pytest
import torch

from qerl.errors import GroupSizeError, QuantizationError
from qerl.formats import nvfp4
from tests.conftest import fresh_seed

E2M1 = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)


@pytest.mark.parametrize(
    ("x", "code"),
    [
        (0.0, 0), (-0.0, 0), (0.25, 0), (0.2501, 1), (0.5, 1), (0.75, 2), (1.0, 2),
        (1.25, 2), (1.2501, 3), (1.75, 4), (2.5, 4), (2.5001, 5), (3.0, 5), (3.5, 6),
        (5.0, 6), (5.0001, 7), (6.0, 7), (100.0, 7), (-0.1, 8), (-0.25, 8), (-0.75, 10),
        (-5.0, 14), (-7.0, 15),
    ],
)
def test_e2m1_rounding_is_nearest_ties_to_even_saturating(x, code):
    assert nvfp4.e2m1_codes(torch.tensor([x], dtype=torch.float32)).item() == code


def test_pack_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    assert nvfp4.pack(codes).tolist() == [[0x21, 0x8F]]
    assert torch.equal(nvfp4.unpack(nvfp4.pack(codes)), codes)


def test_unpack_inverts_pack_on_random_codes():
    codes = torch.randint(0, 16, (37, 96), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(fresh_seed()))
    assert torch.equal(nvfp4.unpack(nvfp4.pack(codes)), codes)


def random_weight(seed: int, dtype: torch.dtype, n: int | None = None, k: int | None = None):
    """Random shapes and magnitudes with outliers, zero blocks/rows and tiny values."""
    gen = torch.Generator().manual_seed(seed)
    n = n or int(torch.randint(1, 97, (1,), generator=gen))
    k = k or 16 * int(torch.randint(1, 25, (1,), generator=gen))
    magnitude = 10 ** float(torch.empty(1).uniform_(-5, 3, generator=gen))
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) * magnitude
    flat = w.view(-1)
    idx = torch.randint(0, flat.numel(), (3,), generator=gen)
    flat[idx] *= 500  # outliers
    w[int(torch.randint(0, n, (1,), generator=gen))] = 0  # zero row
    w[int(torch.randint(0, n, (1,), generator=gen)), :16] = 0  # zero block
    w[int(torch.randint(0, n, (1,), generator=gen)), -16:] *= 1e-7  # tiny block
    finfo = torch.finfo(dtype)
    return w.clamp(finfo.min, finfo.max).to(dtype)


def compressed_tensors_reference(weight: torch.Tensor, absmax: torch.Tensor | None = None):
    """What llmcompressor's NVFP4A16 path computes, through compressed-tensors' own code:
    min/max observer statistics -> generate_gparam -> calculate_qparams -> compress."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    n, k = weight.shape
    groups = weight.reshape(n, k // 16, 16)
    mins, maxs = groups.amin(-1), groups.amax(-1)
    if absmax is None:
        absmax = torch.max(-mins.min(), maxs.max())
    gscale = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    scale, _ = calculate_qparams(mins, maxs, scheme.weights, global_scale=gscale)
    # The live model keeps weight_scale in the weight's dtype until it is compressed.
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype),
             "weight_global_scale": gscale}
    return NVFP4PackedCompressor.compress(state, scheme)


def assert_same_bits(q: nvfp4.NVFP4Tensor, ref: dict, context: str):
    assert torch.equal(q.packed, ref["weight_packed"]), f"codes differ: {context}"
    assert torch.equal(q.scale.view(torch.uint8), ref["weight_scale"].view(torch.uint8)), (
        f"block scales differ: {context}"
    )
    assert torch.equal(q.global_scale, ref["weight_global_scale"]), f"global scale: {context}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bit_exact_with_compressed_tensors_on_random_weights(dtype):
    for _ in range(12):
        seed = fresh_seed()
        w = random_weight(seed, dtype)
        assert_same_bits(nvfp4.quantize(w), compressed_tensors_reference(w),
                         f"seed {seed} {dtype} {tuple(w.shape)}")


def test_fused_layers_share_the_smallest_global_scale_bit_exactly():
    seed = fresh_seed()
    q, k, v = (random_weight(seed + i, torch.bfloat16, n=rows, k=64)
               for i, rows in enumerate((64, 32, 32)))
    shared = nvfp4.shared_global_scale(q, k, v)
    assert shared == min(nvfp4.shared_global_scale(w) for w in (q, k, v))
    absmax = torch.stack([w.abs().amax() for w in (q, k, v)]).amax()
    for w in (q, k, v):
        assert_same_bits(nvfp4.quantize(w, shared), compressed_tensors_reference(w, absmax),
                         f"seed {seed}")


def test_global_scale_division_happens_in_the_weights_dtype():
    # llmcompressor computes 2688 / amax on a bf16 tensor, which torch evaluates as
    # reciprocal-then-multiply, each rounded to bf16: 1 / 2.9375 -> 0.33984375, times 2688
    # = 913.5 -> 912. In fp32 the same division gives 915.06.
    w = torch.full((1, 16), 2.9375, dtype=torch.bfloat16)
    assert nvfp4.shared_global_scale(w).item() == 912.0
    assert nvfp4.shared_global_scale(w.float()).item() == pytest.approx(915.0638, abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_equals_compressed_tensors_decompression(dtype):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    for _ in range(5):
        seed = fresh_seed()
        q = nvfp4.quantize(random_weight(seed, dtype))
        state = {"weight_packed": q.packed, "weight_scale": q.scale,
                 "weight_global_scale": q.global_scale}
        theirs = NVFP4PackedCompressor.decompress(state, scheme)["weight"]  # bf16
        assert torch.equal(nvfp4.dequantize(q, torch.bfloat16), theirs), f"seed {seed}"


def test_dequantized_values_are_the_nearest_grid_points_float64():
    """An independent float64 check of the rounding: each code's value is a nearest E2M1
    point of w / divisor (saturating), and dequantize is value * divisor."""
    for dtype in (torch.bfloat16, torch.float32):
        seed = fresh_seed()
        w = random_weight(seed, dtype)
        q = nvfp4.quantize(w)
        divisor = (q.scale.double() / q.global_scale.double()).repeat_interleave(16, dim=1)
        x = (w.double() / divisor).clamp(-6, 6)
        got = nvfp4.e2m1_values(nvfp4.unpack(q.packed), torch.float64)
        grid = torch.cat([E2M1, -E2M1])
        best = (x.unsqueeze(-1) - grid).abs().amin(-1)
        # fp32 division may move a value across a tie by one ulp: allow 1e-6 relative.
        assert ((x - got).abs() <= best + 1e-6 * x.abs()).all(), f"seed {seed} {dtype}"
        deq = nvfp4.dequantize(q, torch.float32).double()
        assert torch.allclose(deq, got * divisor, rtol=1e-6, atol=0), f"seed {seed}"


def test_dequantize_error_is_small_relative_to_the_weight():
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(fresh_seed()))
    rel = (nvfp4.dequantize(nvfp4.quantize(w), torch.float32) - w).norm() / w.norm()
    assert 0.05 < rel < 0.15  # NVFP4 on Gaussian weights: about 10%


def test_all_zero_weight_gets_global_scale_one_and_zero_codes():
    q = nvfp4.quantize(torch.zeros(3, 32, dtype=torch.bfloat16))
    assert q.global_scale.item() == 1.0
    assert (q.packed == 0).all() and (q.scale.float() == nvfp4.ZERO_SCALE_REPLACEMENT).all()
    assert_same_bits(q, compressed_tensors_reference(torch.zeros(3, 32, dtype=torch.bfloat16)), "0")


@pytest.mark.parametrize(
    ("weight", "match", "error"),
    [
        (torch.randn(4, 24), "K = 24 is not a multiple of 16", GroupSizeError),
        (torch.randn(32), "expected a 2-D weight", QuantizationError),
        (torch.ones(4, 32, dtype=torch.int32), "floating-point", QuantizationError),
        (torch.full((4, 32), float("nan")), "128 NaN/Inf", QuantizationError),
        (torch.tensor([[float("inf")] + [0.0] * 15]), "1 NaN/Inf", QuantizationError),
    ],
)
def test_bad_weights_raise_errors_naming_the_layer(weight, match, error):
    with pytest.raises(error, match=match) as info:
        nvfp4.quantize(weight, name="model.layers.3.mlp.down_proj")
    assert "model.layers.3.mlp.down_proj" in str(info.value)


def test_packed_tensor_rejects_mismatched_parts():
    q = nvfp4.quantize(torch.randn(8, 64))
    with pytest.raises(QuantizationError, match="weight_scale must be"):
        nvfp4.NVFP4Tensor(q.packed, q.scale[:, :2], q.global_scale)
    with pytest.raises(QuantizationError, match="weight_packed must be"):
        nvfp4.NVFP4Tensor(q.packed.to(torch.int8), q.scale, q.global_scale)
    with pytest.raises(QuantizationError, match="weight_global_scale"):
        nvfp4.NVFP4Tensor(q.packed, q.scale, q.global_scale.double())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_quantization_equals_cpu_bit_for_bit():
    for dtype in (torch.bfloat16, torch.float32):
        seed = fresh_seed()
        w = random_weight(seed, dtype, n=512, k=1024)
        cpu, gpu = nvfp4.quantize(w), nvfp4.quantize(w.cuda()).to("cpu")
        assert_same_bits(gpu, {"weight_packed": cpu.packed, "weight_scale": cpu.scale,
                               "weight_global_scale": cpu.global_scale}, f"seed {seed}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rounds_an_fp8_tie_of_the_block_scale_as_the_cpu_does():
    """2688 / 9.625 * (0.045654296875 / 6) is 2.125 in fp32, an FP8 tie (2 | 2.25; the
    tiny model's layers.0 gate/up pair has 23 such blocks). CUDA computed ``tensor / 6.0``
    as a multiply by 1/6, one ulp above the quotient, and rounded the tie up."""
    w = torch.zeros(2, 16)
    w[0, 0], w[1, 0] = 9.625, 0.045654296875
    cpu, gpu = nvfp4.quantize(w), nvfp4.quantize(w.cuda()).to("cpu")
    assert cpu.scale[1, 0].float() == 2.0
    assert torch.equal(gpu.scale.float(), cpu.scale.float())
    assert torch.equal(gpu.packed, cpu.packed)
