"""The CUDA small-M NVFP4 kernel (kernels/nvfp4_gemv.cu): on a GPU its results against
float64 on odd shapes, for every launch shape, deterministic and inside CUDA graphs (its
build: test_cuda_build.py)."""

from __future__ import annotations

import pytest
import torch

from qerl.errors import QuantizationError
from qerl.formats import nvfp4
from qerl.kernels import nvfp4_gemv as gemv
from qerl.kernels import nvfp4_layout as layout
from tests.conftest import fresh_seed

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def weight(n: int, k: int, gen: torch.Generator):
    q = nvfp4.quantize(torch.randn(n, k, generator=gen) * 0.05).to("cuda")
    return q, (layout.to_pairs(q.packed), q.scale, q.global_scale)


def test_unavailable_off_cuda():
    assert "not a CUDA device" in gemv.unavailable_reason(torch.device("cpu"))


def test_launch_shape_fills_the_gpu_within_the_limits():
    for m, n, k in [(1, 37888, 3584), (16, 3584, 18944), (8, 48, 64), (32, 24, 16)]:
        for rank in (0, 32):
            splits, k_warps = gemv.launch_shape(m, [n], k, 132, rank)
            quads = -(-k // 128)
            assert 1 <= splits <= min(gemv.MAX_SPLITS, quads)
            assert k_warps in (1, 2, 4) and k_warps <= max(1, quads // splits)
    assert gemv.launch_shape(1, [37888], 3584, 132) == (1, 4)  # 7B gate_up: fills it alone
    for m in (9, 16, 32):  # shared x: the block's warps share one K range
        assert gemv.launch_shape(m, [3584, 512, 512], 3584, 132)[1] == 1


def _grid(widths, splits, rank):
    blocks = sum(-(-n // 64) for n in widths) + (len(widths) * -(-rank // 4) if rank else 0)
    return blocks * splits


@pytest.mark.parametrize("rank", [0, 32])
def test_shared_x_splits_leave_no_slice_empty_and_no_short_last_wave(rank):
    """Above 8 rows every split has quads of K to do (its partial is written), and where a
    one-wave grid is near the best, the policy does not pick one just past a wave, which
    ran slower at 17-32 rows on an H200 (7B o: 640 blocks where 528 fit)."""
    sms = 132
    for widths, k in [([3584, 512, 512], 3584), ([3584], 3584), ([18944, 18944], 3584),
                      ([3584], 18944), ([5120, 1024, 1024], 5120), ([5120], 27648),
                      ([2048, 256, 256], 2048), ([40], 80)]:
        quads = -(-k // 128)
        for m in range(9, 33):
            splits, _ = gemv.launch_shape(m, widths, k, sms, rank)
            per_split = -(-quads // splits)
            assert -(-quads // per_split) == splits, (widths, k, m, splits)
    resident = 4 * sms  # blocks an SM holds at 17-32 rows, by the launch bounds
    for m in (17, 24, 32):
        splits, _ = gemv.launch_shape(m, [3584], 3584, sms, rank)  # 7B o
        assert _grid([3584], splits, rank) <= resident
        # 7B gate_up: one split is 592 (+16) blocks, 1.12 waves; two cost 10% less.
        assert gemv.launch_shape(m, [18944, 18944], 3584, sms, rank)[0] == 2


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_float64_on_odd_shapes(poisoned, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    # K % 32 == 16 (a padded half chunk), N not a multiple of 16, every M tile count.
    for m, n, k in [(1, 48, 64), (3, 80, 96), (10, 40, 272), (17, 144, 48), (32, 24, 208),
                    (1, 17, 16), (31, 33, 80), (24, 1000, 3584), (9, 3584, 4736)]:
        q, w4 = weight(n, k, gen)
        x = torch.randn(m, k, generator=gen).to(dtype).cuda()
        bias = torch.randn(n, generator=gen).to(dtype).cuda()
        parts = gemv.partials(x, *w4, bias, n, k)
        assert not parts.isnan().any(), f"unwritten output, seed {seed}"
        ref = x.double() @ nvfp4.dequantize(q, torch.float64).T + bias.double()
        got = parts.double().sum(0)
        err = ((got - ref).norm() / ref.norm()).item()
        # Products are exact; what remains is fp32 accumulation and 16-bit output rounding.
        assert err < (8e-3 if dtype == torch.bfloat16 else 1.5e-3), (m, n, k, seed)


@GPU
@pytest.mark.gpu
def test_every_launch_shape_gives_the_same_sum_and_repeats_bit_for_bit(poisoned):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, k = 200, 1040
    q, w4 = weight(n, k, gen)
    w = nvfp4.dequantize(q, torch.float64)
    # Up to 8 rows the block's warps may split K; above, they share x in shared memory.
    for m, warps in ((7, (1, 2, 4)), (13, (1,)), (32, (1,))):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
        ref = x.double() @ w.T
        for splits in (1, 3, 16):
            for k_warps in warps:
                a = gemv.partials(x, *w4, None, n, k, splits=splits, k_warps=k_warps)
                b = gemv.partials(x, *w4, None, n, k, splits=splits, k_warps=k_warps)
                assert a.shape == (splits, m, n)
                assert a.dtype == (torch.float32 if splits > 1 else torch.bfloat16)
                assert torch.equal(a, b), (m, splits, k_warps, seed)
                err = ((a.double().sum(0) - ref).norm() / ref.norm()).item()
                assert err < 8e-3, (m, splits, k_warps, seed)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("widths", [[3584, 512, 512], [40, 17, 200], [96, 1000]])
def test_one_launch_of_several_weights_equals_one_launch_each(poisoned, widths):
    """q/k/v-like members (own scales, global scales and biases; widths off the 16-row
    strip) in one launch: bit for bit the members' own launches of the same shape."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    k = 1040
    members = []
    for n in widths:
        _, w4 = weight(n, k, gen)
        members.append(gemv.Weight(*w4, torch.randn(n, generator=gen).to(torch.bfloat16)
                                   .cuda(), n))
    for m, shapes in ((1, ((1, 4), (3, 2), (16, 1))), (13, ((1, 1), (3, 1), (16, 1)))):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
        for splits, k_warps in shapes:
            got = gemv.grouped_partials(x, members, k, splits, k_warps)
            assert got.shape == (splits, m, sum(widths))
            each = torch.cat([gemv.partials(x, w.pairs, w.scale, w.global_scale, w.bias,
                                            w.n, k, splits, k_warps) for w in members], -1)
            assert torch.equal(got, each), (m, splits, k_warps, seed)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shrink_in_the_launch_matches_float64_and_leaves_the_weights_alone(poisoned, dtype):
    """The LoRA shrink's blocks of a launch: their partial sums over the launch's K slices
    add up to x @ A_g^T (fp32 adapters, as PEFT keeps them) to fp32 rounding, for every
    token count, launch shape, rank off the 4-row block and K off the 128-weight quad;
    the weights' partials are bit for bit those of a launch without them."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    k, widths = 336, [200, 40, 17]
    members = [gemv.Weight(*weight(n, k, gen)[1], None, n) for n in widths]
    for m, rank, shapes in ((1, 13, ((1, 4), (3, 2), (None, None))),
                            (6, 64, ((2, 1), (None, None))),
                            (16, 8, ((1, 1), (3, 1))), (29, 5, ((None, None),))):
        x = torch.randn(m, k, generator=gen).to(dtype).cuda()
        for group in (1, 3):
            a = [torch.randn(rank, k, generator=gen).cuda() * 0.1 for _ in range(group)]
            ref = x.double() @ torch.cat(a).double().T
            for splits, k_warps in shapes:
                parts, xa = gemv.grouped_partials_and_shrink(x, members[:group], k, a, splits,
                                                             k_warps)
                assert xa.shape == (parts.shape[0], m, group * rank), (m, rank, splits)
                assert torch.equal(parts, gemv.grouped_partials(x, members[:group], k,
                                                                splits, k_warps)), seed
                torch.testing.assert_close(xa.double().sum(0), ref, atol=1e-5, rtol=1e-5,
                                           msg=lambda e, c=(m, rank, splits): f"{seed} {c}: {e}")


def test_shrink_in_the_launch_refuses_what_it_cannot_run():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    w = gemv.Weight(torch.zeros(1), torch.zeros(1), torch.zeros(1), None, 16)
    with pytest.raises(QuantizationError, match="one adapter A per weight"):
        gemv.grouped_partials_and_shrink(x, [w], 64, [torch.zeros(4, 64)] * 2)
    for a in (torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, 63),
              torch.zeros(64, 4).T):
        with pytest.raises(QuantizationError, match="fp32 adapters"):
            gemv.grouped_partials_and_shrink(x, [w], 64, [a])


@GPU
@pytest.mark.gpu
def test_replays_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(fresh_seed())
    _, w4 = weight(512, 1024, gen)
    x = torch.randn(4, 1024, generator=gen).to(torch.bfloat16).cuda()
    eager = gemv.partials(x, *w4, None, 512, 1024)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        captured = gemv.partials(x, *w4, None, 512, 1024)
    x.copy_(torch.randn(4, 1024, generator=gen).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, gemv.partials(x, *w4, None, 512, 1024))
    assert not torch.equal(captured, eager)


@GPU
@pytest.mark.gpu
def test_refuses_what_it_cannot_run():
    gen = torch.Generator().manual_seed(fresh_seed())
    _, w4 = weight(64, 128, gen)
    with pytest.raises(QuantizationError, match="1 to 32"):
        gemv.partials(torch.zeros(33, 128, dtype=torch.bfloat16, device="cuda"), *w4, None,
                      64, 128)
    rows = torch.zeros(2, 129, dtype=torch.bfloat16, device="cuda")[:, 1:]
    with pytest.raises(QuantizationError, match="contiguous"):
        gemv.partials(rows, *w4, None, 64, 128)
    flat = torch.zeros(2 * 128 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(2, 128)
    with pytest.raises(QuantizationError, match="aligned"):
        gemv.partials(flat, *w4, None, 64, 128)
    with pytest.raises(QuantizationError, match="k_warps must be 1"):
        gemv.partials(torch.zeros(9, 128, dtype=torch.bfloat16, device="cuda"), *w4, None,
                      64, 128, splits=1, k_warps=2)
