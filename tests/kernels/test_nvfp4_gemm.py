"""The Hopper NVFP4 GEMM (kernels/nvfp4_gemm.cu): x's column order against its definition
and the Triton copy that makes it (interpreter), the launch shapes, and on an sm_90 GPU
every instance against float64 on odd shapes, deterministic, through nvfp4_linear."""

from __future__ import annotations

import itertools

import pytest
import torch

from qerl.errors import QuantizationError
from qerl.formats import nvfp4
from qerl.kernels import crossovers
from qerl.kernels import device_facts as facts
from qerl.kernels import nvfp4_gemm as gemm
from qerl.kernels import nvfp4_layout as layout
from qerl.kernels import nvfp4_matmul as km
from tests.conftest import fresh_seed

HOPPER = pytest.mark.skipif(
    not (torch.cuda.is_available() and gemm.available(torch.device("cuda"))),
    reason="needs an sm_90 GPU with nvcc")


def test_gemm_order_is_the_k_order_of_the_weight_fragments():
    """Column 32t + 16hi + 4w + 2h + e of a quad (chunk t, its low or high group, word w,
    pair h, element e) lands at 16 (2w + h) + 8hi + 2t + e: the k slot that the decoded
    weight's register fragment holds it in."""
    x = torch.arange(2 * 128).view(1, 256)
    got = layout.gemm_order(x, 2)[0]
    for q, t, hi, w, h, e in itertools.product(range(2), range(4), range(2), range(4),
                                               range(2), range(2)):
        assert got[128 * q + 16 * (2 * w + h) + 8 * hi + 2 * t + e] == (
            128 * q + 32 * t + 16 * hi + 4 * w + 2 * h + e)


def test_gemm_tiles_are_the_ordered_columns_in_swizzled_row_tiles():
    """Column 64h + 8c + e of quad q (gemm_order's) of row r lands in tile (q, h), row r, at
    16-byte chunk c ^ r % 8: a tile is what wgmma reads with the 128-byte swizzle. Rows
    past M are zeros."""
    m, quads, rows = 11, 2, 16
    x = torch.arange(m * 256, dtype=torch.float64).view(m, 256)
    ordered = layout.gemm_order(x, quads)
    got = layout.gemm_tiles(x, quads, rows)
    assert got.shape == (quads, 2, rows, 64)
    for q, h, r, c, e in itertools.product(range(quads), range(2), range(rows), range(8),
                                           range(8)):
        want = ordered[r, 128 * q + 64 * h + 8 * c + e] if r < m else 0
        assert got[q, h, r, 8 * (c ^ r % 8) + e] == want
    with pytest.raises(QuantizationError, match="rows >= M = 11"):
        layout.gemm_tiles(x, quads, 8)


@pytest.mark.skipif(not (torch.cuda.is_available() or facts.interpreting()),
                    reason="no GPU and no interpreter")
@pytest.mark.parametrize(("m", "k", "rows"), [(1, 128, 64), (5, 384, 64), (33, 200, 128),
                                              (17, 130, 192)])
def test_the_copy_kernel_tiles_and_pads_as_the_definition_and_zeroes_the_flags(m, k, rows):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(fresh_seed())).to(dev)
    x = x.to(torch.bfloat16)
    quads = -(-k // 128)
    ready = torch.full((300,), 7, dtype=torch.int32, device=dev)
    got = gemm.gemm_tiles(torch.nn.functional.pad(x, (0, 5))[:, :k], quads, rows, ready)
    assert torch.equal(got, layout.gemm_tiles(x, quads, rows))
    assert not ready.any()  # the GEMM's flags, zeroed on the way


@pytest.mark.parametrize("m", [33, 64, 65, 128, 300, 8192])
@pytest.mark.parametrize(("n", "k"), [(37888, 3584), (3584, 18944), (200, 384)])
def test_launch_shapes_fill_the_gpu_with_no_block_idle(m, n, k):
    launch = gemm.launch_for(m, n, k, 132)
    assert launch.token_tile == gemm.token_tile(m) in gemm.TOKEN_TILES
    work = gemm.units(m, n, k, launch.token_tile)
    slots = 132  # a block an SM
    assert 1 <= launch.blocks <= min(slots, work)
    assert launch.blocks == slots or work < gemm.MIN_UNITS * (launch.blocks + 1)


def test_a_launch_with_more_blocks_than_units_is_refused():
    q = nvfp4.quantize(torch.randn(32, 128) * 0.05)
    with pytest.raises(QuantizationError, match="blocks outside 1..1"):
        gemm.linear(torch.zeros(40, 128, dtype=torch.bfloat16), layout.to_pairs(q.packed),
                    q.scale, q.global_scale, None, 128, launch=gemm.Launch(64, 2))


def test_only_whole_aligned_quads_of_k_are_supported():
    def weight(k):
        return torch.zeros(8, max(k, 16) // 16, dtype=torch.float8_e4m3fn), torch.zeros(
            64, dtype=torch.uint8)

    scale, pairs = weight(384)
    assert gemm.supports(384, scale, pairs)
    assert not gemm.supports(400, *weight(400))
    assert not gemm.supports(0, *weight(0))
    assert not gemm.supports(384, scale, pairs[1:])  # codes off a 16-byte boundary
    assert not gemm.supports(384, torch.zeros(8, 25, dtype=torch.float8_e4m3fn)[:, :24],
                             pairs)  # rows 25 bytes apart


def test_unavailable_off_cuda_and_named_when_forced():
    assert "not a CUDA device" in gemm.unavailable_reason(torch.device("cpu"))
    q = nvfp4.quantize(torch.randn(32, 128) * 0.05)
    x = torch.randn(40, 128).to(torch.bfloat16)
    if facts.interpreting():
        with pytest.raises(QuantizationError, match="Hopper NVFP4 GEMM cannot run here"):
            km.nvfp4_linear(x, layout.to_pairs(q.packed), q.scale, q.global_scale,
                            path="gemm")


def _weight(n: int, k: int, seed: int):
    q = nvfp4.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
                       * 0.05).to("cuda")
    return q, (layout.to_pairs(q.packed), q.scale, q.global_scale)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(200, 384), (520, 640), (4608, 3584)])
def test_every_instance_matches_float64(poisoned, dtype, n, k):
    """Each token tile with blocks that each take whole tiles, pieces of one (a tile summed
    from up to all of them), and both, on rows that fill no tile (1, 33, 65, 130, 300) and
    odd N: within the output's rounding of float64, and bit for bit again."""
    seed = fresh_seed()
    q, w = _weight(n, k, seed)
    w64 = nvfp4.dequantize(q, torch.float64)
    gen = torch.Generator().manual_seed(seed)
    for m in (1, 33, 65, 130, 300):
        x = torch.randn(m, k, generator=gen).to(dtype).cuda()
        bias = torch.randn(n, generator=gen).to(dtype).cuda()
        ref = x.double() @ w64.T + bias.double()
        for bm in gemm.TOKEN_TILES:
            work = gemm.units(m, n, k, bm)
            for blocks in sorted({1, 2, 3, min(work, 7), min(work, 132), work}):
                launch = gemm.Launch(bm, blocks)
                got = gemm.linear(x, *w, bias, k, launch=launch)
                err = ((got.double() - ref).norm() / ref.norm()).item()
                tol = 4e-3 if dtype == torch.bfloat16 else 6e-4
                assert err < tol, f"m={m} {launch}, seed {seed}: {err:.2e}"
                again = gemm.linear(x, *w, bias, k, launch=launch)
                assert torch.equal(got, again), f"not deterministic: m={m} {launch}, seed {seed}"


@pytest.mark.gpu
@HOPPER
def test_nvfp4_linear_takes_the_gemm_up_to_its_crossover(poisoned):
    seed = fresh_seed()
    n, k = 37888, 3584
    q, w = _weight(n, k, seed)
    most = crossovers.gemm_max_m(torch.cuda.get_device_name(), n, k)
    assert most > crossovers.FROM_M, "the GEMM wins somewhere on every measured card"
    x = torch.randn(most + 1, k, generator=torch.Generator().manual_seed(seed)).to(
        torch.bfloat16).cuda()
    assert km.forward_path(x[:most], *w[:2]) == "gemm"
    assert km.forward_path(x, *w[:2]) == "dequant"
    ref = x[:most].double() @ nvfp4.dequantize(q, torch.float64).T
    got = km.nvfp4_linear(x[:most], *w)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 4e-3, f"seed {seed}"


def test_weights_share_a_launch_when_every_one_but_the_last_fills_whole_tiles():
    assert gemm.groups([3584, 512, 512]) and gemm.groups([256, 200])
    assert not gemm.groups([200, 256])  # a tile would read two weights
    assert not gemm.groups([128] * 4) and not gemm.groups([])
    q = nvfp4.quantize(torch.randn(200, 128) * 0.05)
    w = (layout.to_pairs(q.packed), q.scale, q.global_scale, None)
    with pytest.raises(QuantizationError, match="multiple of 128 rows; got \\[200, 200\\]"):
        gemm.linear_group(torch.zeros(40, 128, dtype=torch.bfloat16), [w, w], 128)
    if facts.interpreting():  # (elsewhere the kernels refuse CPU tensors)
        assert km.nvfp4_linear_grouped(torch.zeros(40, 128, dtype=torch.bfloat16), [w]) is None


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_group_of_weights_matches_float64_side_by_side(poisoned, dtype):
    """q/k/v-like members (the last one odd, each its own global scale and bias) in one
    launch: each member's columns within the output's rounding of float64, for launches
    whose pieces straddle members, and through nvfp4_linear_grouped."""
    seed = fresh_seed()
    k, ns = 640, (384, 128, 72)
    members = [_weight(n, k, seed + i) for i, n in enumerate(ns)]
    gen = torch.Generator().manual_seed(seed)
    biases = [torch.randn(n, generator=gen).to(dtype).cuda() for n in ns]
    weights = [(*w, b) for (_, w), b in zip(members, biases, strict=True)]
    tol = 4e-3 if dtype == torch.bfloat16 else 6e-4
    for m in (33, 100):
        x = torch.randn(m, k, generator=gen).to(dtype).cuda()
        refs = [x.double() @ nvfp4.dequantize(q, torch.float64).T + b.double()
                for (q, _), b in zip(members, biases, strict=True)]
        for launch in (None, gemm.Launch(64, 5), gemm.Launch(128, 2), gemm.Launch(256, 3)):
            out = gemm.linear_group(x, weights, k, launch)
            assert out.shape == (m, sum(ns))
            starts = (0, 384, 512, 584)
            for i, ref in enumerate(refs):
                got = out[:, starts[i]:starts[i + 1]].double()
                err = ((got - ref).norm() / ref.norm()).item()
                assert err < tol, f"member {i}, m={m} {launch}, seed {seed}: {err:.2e}"
    x = torch.randn(48, k, generator=gen).to(dtype).cuda()
    outs = km.nvfp4_linear_grouped(x, weights)
    if crossovers.gemm_max_m(torch.cuda.get_device_name(), sum(ns), k) < 48:
        assert outs is None  # each weight takes its own path
        return
    for (q, _), b, out in zip(members, biases, outs, strict=True):
        ref = x.double() @ nvfp4.dequantize(q, torch.float64).T + b.double()
        assert ((out.double() - ref).norm() / ref.norm()).item() < tol, f"seed {seed}"


def test_the_token_tile_makes_the_cheapest_passes_over_the_weight():
    """64 up to 64 rows; above, one pass of the tile that holds the rows (no wider than
    256), then the tiles whose passes cost least: two of 192 for 257-384 rows, not two of
    256 nor three of 128."""
    assert [gemm.token_tile(m) for m in (1, 64, 65, 128, 129, 192, 193, 256)] == [
        64, 64, 128, 128, 192, 192, 256, 256]
    assert [gemm.token_tile(m) for m in (257, 384, 385, 512, 2048, 9000)] == [
        192, 192, 256, 256, 256, 256]
