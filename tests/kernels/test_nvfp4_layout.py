"""The kernels' pair-interleaved tiles: the CUDA kernel's word decode reads every code from
its place, exact round trips, odd group counts, rows and widths past a tile."""

from __future__ import annotations

import pytest
import torch

from qerl.errors import QuantizationError
from qerl.formats import nvfp4
from qerl.kernels import nvfp4_layout as layout
from tests.conftest import fresh_seed


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF


def _word_codes(words: torch.Tensor) -> torch.Tensor:
    """The CUDA kernel's decode, in torch: words [..., W] (as uint32 in int64) -> their
    codes [..., W, 8] as (L0, L1, L2, L3, H0, H1, H2, H3), each read back from the bf16
    bits the decode leaves (magnitude 6-8, sign 15 of a half)."""
    mask, (l23, h01), (spread, times) = layout.CODE_BITS, layout.ROTATIONS, layout.SPREAD
    pairs = (words & mask, _rotl(words, l23) & mask, _rotl(words, h01) & mask,
             ((words & spread) * times) & mask)
    for pair in pairs:  # nothing but a code's bits survives
        assert not (pair & ~mask).any()
    halves = [h for pair in pairs for h in (pair & 0xFFFF, pair >> 16)]
    return torch.stack([(h >> 6) & 7 | (h >> 12) & 8 for h in halves], -1)


@pytest.mark.parametrize(("n", "k"), [(1, 16), (3, 32), (5, 48), (17, 208), (2, 1024),
                                    (33, 144)])
def test_tiles_decode_to_one_group_per_half_chunk_and_round_trip(n, k):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    tiles = layout.to_pairs(nvfp4.pack(codes))
    assert tiles.shape == layout.tiles_shape(n, k) == (-(-n // 16), -(-k // 128), 16, 64)
    padded = torch.nn.functional.pad(codes, (0, tiles.shape[1] * 128 - k,
                                             0, tiles.shape[0] * 16 - n))
    words = tiles.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    decoded = _word_codes(words)  # [row tiles, quads, 16 rows, 16 words, 8]
    for row in range(padded.shape[0]):
        for p in range(tiles.shape[1] * 4):
            got = decoded[row // 16, p // 4, row % 16, 4 * (p % 4):4 * (p % 4 + 1)]
            want = padded[row, 32 * p:32 * p + 32].reshape(2, 4, 4).transpose(0, 1)
            assert torch.equal(got, want.reshape(4, 8).long()), f"seed {seed}"
    assert torch.equal(layout.from_pairs(tiles, n, k), nvfp4.pack(codes)), f"seed {seed}"


def test_word_shuffle_moves_every_bit_once():
    for moves in (layout.TO_WORD, layout.FROM_WORD):
        masks = [mask for mask, _ in moves]
        assert sum(masks) == 0xFFFFFFFF and sum(bin(m).count("1") for m in masks) == 32


def test_mismatched_shapes_are_named():
    q = nvfp4.quantize(torch.randn(4, 48))
    tiles = layout.to_pairs(q.packed)
    assert layout.check_layer(tiles, q.scale, q.global_scale) == (4, 48)
    with pytest.raises(QuantizationError, match="4-D uint8"):
        layout.check_layer(q.packed, q.scale, q.global_scale)
    with pytest.raises(QuantizationError, match="4-D uint8"):
        layout.check_layer(tiles.to(torch.int32), q.scale, q.global_scale)
    with pytest.raises(QuantizationError, match=r"\[4, 144\] weight need tiles of shape"):
        layout.check_layer(tiles, torch.cat([q.scale] * 3, 1), q.global_scale)
    with pytest.raises(QuantizationError, match="the tiles of the codes must be contiguous"):
        layout.check_layer(tiles.transpose(2, 3).contiguous().transpose(2, 3), q.scale,
                           q.global_scale)
    with pytest.raises(QuantizationError, match="weight_scale must be float8_e4m3fn of shape"):
        layout.check_layer(tiles, q.scale.float(), q.global_scale)
