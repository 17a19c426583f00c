"""The kernels' pair-interleaved layout: the formula, exact round trips, odd group counts."""

from __future__ import annotations

import pytest
import torch

from qerl.errors import QuantizationError
from qerl.formats import nvfp4
from qerl.kernels import nvfp4_layout as layout
from tests.conftest import fresh_seed


@pytest.mark.parametrize(("n", "k"), [(1, 16), (3, 32), (5, 48), (7, 208), (2, 1024)])
def test_pairs_put_one_group_in_each_nibble_and_round_trip(n, k):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    pairs = layout.to_pairs(nvfp4.pack(codes))
    assert pairs.shape == (n, layout.pairs_width(k)) == (n, 16 * -(-k // 32))
    padded = torch.nn.functional.pad(codes, (0, pairs.shape[1] * 2 - k))
    for p in range(pairs.shape[1] // 16):
        chunk = pairs[:, 16 * p:16 * (p + 1)]
        assert torch.equal(chunk & 0xF, padded[:, 32 * p:32 * p + 16]), f"seed {seed}"
        assert torch.equal(chunk >> 4, padded[:, 32 * p + 16:32 * p + 32]), f"seed {seed}"
    assert torch.equal(layout.from_pairs(pairs, k), nvfp4.pack(codes)), f"seed {seed}"


def test_mismatched_shapes_are_named():
    q = nvfp4.quantize(torch.randn(4, 48))
    pairs = layout.to_pairs(q.packed)
    assert layout.check_layer(pairs, q.scale, q.global_scale) == (4, 48)
    with pytest.raises(QuantizationError, match="for K=48 need 32 bytes per row, got 24"):
        layout.check_layer(q.packed, q.scale, q.global_scale)
    with pytest.raises(QuantizationError, match="2-D uint8"):
        layout.check_layer(pairs.to(torch.int32), q.scale, q.global_scale)
    with pytest.raises(QuantizationError, match="weight_scale must be float8_e4m3fn of shape"):
        layout.check_layer(pairs[:3], q.scale, q.global_scale)
