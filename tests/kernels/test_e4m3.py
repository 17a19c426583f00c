"""E4M3 in the kernels (kernels/e4m3.py) against torch's own float8_e4m3fn: written from its
bits, bit for bit as ``x.clamp(-448, 448).to(torch.float8_e4m3fn)`` (every value, every
tie between neighbours and one fp32 ulp either side of it, subnormals, saturation, inf,
NaN, random magnitudes), and read back by the hardware's conversion and from the bits, as
a card before sm_89 reads them."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from qerl.kernels.compute_capability import converts_fp8
from qerl.kernels.device_facts import interpreting
from qerl.kernels.e4m3 import e4m3_as, e4m3_bits
from tests.conftest import fresh_seed
from tests.kernels.conftest import device

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                                reason="no GPU and no interpreter")
BLOCK = 1024


@triton.jit
def _round_trip(x_ptr, bits_ptr, out_ptr, N, BLOCK: tl.constexpr, FP8: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    bits = e4m3_bits(tl.load(x_ptr + i, mask=ok))
    tl.store(bits_ptr + i, bits, mask=ok)
    # read back: as fp8 (the hardware's conversion) or as its bits
    stored = bits.to(tl.float8e4nv, bitcast=True) if FP8 else bits
    tl.store(out_ptr + i, e4m3_as(stored, tl.float32, FP8), mask=ok)


def every_finite() -> torch.Tensor:
    """The 254 finite E4M3 values (both zeros), as fp32."""
    bits = torch.arange(256, dtype=torch.int32)
    return bits[bits & 0x7F != 0x7F].to(torch.uint8).view(torch.float8_e4m3fn).float()


def hard_inputs(seed: int) -> torch.Tensor:
    values = every_finite()
    up = values.unique()
    ties = ((up[1:].double() + up[:-1].double()) / 2).float()  # exact in fp32
    big = torch.tensor(1e30)
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp2(torch.randint(-30, 20, (20000,), generator=gen).float())
    special = torch.tensor([448.0, 464.0, 479.9, 480.0, 1e6, float("inf"), 2.0 ** -6,
                            2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 1e-30, 1e-45, 0.0])
    x = torch.cat([values, ties, torch.nextafter(ties, big), torch.nextafter(ties, -big),
                   special, torch.randn(20000, generator=gen) * magnitudes])
    return torch.cat([x, -x])


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8-conversion", "bits"])
def test_written_as_torch_casts_and_read_back_as_torch_reads(poisoned, fp8):
    if fp8 and not converts_fp8(torch.device(device())):
        pytest.skip("this card has no fp8 conversion")
    seed = fresh_seed()
    x = hard_inputs(seed).to(device())
    bits = torch.empty(x.numel(), dtype=torch.uint8, device=device())
    out = torch.empty(x.numel(), device=device())
    _round_trip[(triton.cdiv(x.numel(), BLOCK),)](x, bits, out, x.numel(), BLOCK=BLOCK,
                                                  FP8=fp8)
    expected = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    wrong = bits != expected.view(torch.uint8)
    assert not wrong.any(), (seed, x[wrong][:8].tolist(), bits[wrong][:8].tolist())
    assert torch.equal(out, expected.float()), seed


def test_nan_stays_nan():
    x = torch.tensor([float("nan"), -float("nan")], device=device())
    bits = torch.empty(2, dtype=torch.uint8, device=device())
    out = torch.empty(2, device=device())
    _round_trip[(1,)](x, bits, out, 2, BLOCK=BLOCK, FP8=False)
    assert bits.tolist() == x.to(torch.float8_e4m3fn).view(torch.uint8).tolist()
