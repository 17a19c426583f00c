"""The kernels' pair-interleaved tiles: the formula, exact round trips, odd group counts,
rows and widths past a tile."""

from __future__ import annotations

import pytest
import torch

from qerl.errors import QuantizationError
from qerl.formats import nvfp4
from qerl.kernels import nvfp4_layout as layout
from tests.conftest import fresh_seed


@pytest.mark.parametrize(("n", "k"), [(1, 16), (3, 32), (5, 48), (17, 208), (2, 1024),
                                    (33, 144)])
def test_tiles_put_one_group_in_each_nibble_and_round_trip(n, k):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    tiles = layout.to_pairs(nvfp4.pack(codes))
    assert tiles.shape == layout.tiles_shape(n, k) == (-(-n // 16), -(-k // 128), 16, 64)
    padded = torch.nn.functional.pad(codes, (0, tiles.shape[1] * 128 - k,
                                             0, tiles.shape[0] * 16 - n))
    for row in range(padded.shape[0]):
        for p in range(tiles.shape[1] * 4):
            chunk = tiles[row // 16, p // 4, row % 16, 16 * (p % 4):16 * (p % 4 + 1)]
            assert torch.equal(chunk & 0xF, padded[row, 32 * p:32 * p + 16]), f"seed {seed}"
            assert torch.equal(chunk >> 4, padded[row, 32 * p + 16:32 * p + 32]), f"seed {seed}"
    assert torch.equal(layout.from_pairs(tiles, n, k), nvfp4.pack(codes)), f"seed {seed}"


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
