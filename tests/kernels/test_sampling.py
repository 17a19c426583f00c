"""The fused sampler (kernels/sampling.py) against torch: greedy tokens and every
log-probability as torch computes them, and draws whose frequencies are the tempered
softmax's, over vocabularies that span several slices and a partial block."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from qerl.kernels import sampling
from qerl.kernels.device_facts import interpreting
from tests.conftest import fresh_seed
from tests.kernels.conftest import device

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()), reason="no GPU and no interpreter")


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=device()).manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_torch_argmax_and_log_softmax(poisoned, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(5, 3001, generator=gen) * 3).to(dtype)
    logits[1, [7, 2050, 3000]] = 40.0  # a tie across slices: the first column wins
    logits[2, 3000] = 50.0  # the winner in the partial last block
    logits = logits.to(device())
    tokens, logprobs = sampling.sample(logits, 0.0, generator(seed))
    ref = torch.log_softmax(logits.float(), -1)
    assert torch.equal(tokens, logits.float().argmax(-1)), seed
    assert tokens[1] == 7 and tokens[2] == 3000
    torch.testing.assert_close(logprobs, ref.gather(-1, tokens[:, None])[:, 0], atol=1e-5,
                               rtol=1e-5, msg=lambda m: f"seed {seed}: {m}")


def test_log_probabilities_are_the_tempered_log_softmax(poisoned):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(7, 2500, generator=gen) * 4).to(device())
    logits[3, :1000] = float("-inf")  # masked entries: never drawn, no NaN
    tokens, logprobs = sampling.sample(logits, 0.7, generator(seed))
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, ref, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed {seed}: {m}")
    assert tokens[3] >= 1000, seed


@triton.jit
def _uniforms_kernel(seed_ptr, out_ptr, N: tl.constexpr):
    """Philox's four outputs at counters 0 .. N - 1, as out [N, 4]."""
    at = tl.arange(0, N)
    u0, u1, u2, u3 = tl.rand4x(tl.load(seed_ptr), at)
    tl.store(out_ptr + at * 4, u0)
    tl.store(out_ptr + at * 4 + 1, u1)
    tl.store(out_ptr + at * 4 + 2, u2)
    tl.store(out_ptr + at * 4 + 3, u3)


def test_a_draw_is_the_argmax_of_logits_plus_gumbel_noise():
    """Exactly the exponential race over the whole row: the noise recomputed from the same
    key (the generator's next draw) and Philox (column c of row r: output c % 4 of counter
    r * ceil(V / 4) + c // 4); small blocks so that rows span three slices of two blocks,
    the last one partial, and V is no multiple of 4."""
    seed = fresh_seed()
    rows, vocab, temperature = 3, 42, 0.8
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).to(device())
    logits[1, 20:24] = float("-inf")
    tokens, _ = sampling.sample(logits, temperature, generator(seed), slices=3, block=8)
    key = torch.randint(0, 2**62, (1,), device=device(), generator=generator(seed))
    per_row = -(-vocab // 4)
    u = torch.empty(64, 4, device=device())
    _uniforms_kernel[(1,)](key, u, N=64)
    u = u[:rows * per_row].view(rows, per_row * 4)[:, :vocab]
    noisy = logits / temperature - torch.log(-torch.log(u))
    assert torch.equal(tokens, noisy.argmax(-1)), seed


@pytest.mark.gpu
@GPU
def test_draws_follow_the_tempered_softmax():
    """40,000 draws at once (one per row) over a vocabulary of several slices, each
    column's frequency within 5 standard deviations of its probability."""
    seed = fresh_seed()
    vocab, draws, temperature = 5000, 40_000, 0.8
    logits = torch.full((vocab,), -30.0)
    hot = torch.tensor([3, 1030, 1031, 2049, 4999])
    logits[hot] = torch.tensor([1.0, 0.2, 0.5, -0.4, 0.8])
    expected = torch.softmax(logits / temperature, -1)
    tokens, _ = sampling.sample(logits.to(device()).expand(draws, -1), temperature,
                                generator(seed), slices=5)
    freq = torch.bincount(tokens.cpu(), minlength=vocab).float() / draws
    sd = (expected * (1 - expected) / draws).sqrt()
    assert ((freq - expected).abs() <= 5 * sd + 1e-6).all(), (seed, freq[hot], expected[hot])


@pytest.mark.parametrize("rows", [1, 7, 64, 256, 512])
def test_slices_fill_the_card_and_stay_short(rows, monkeypatch):
    """~4 programs an SM, and at RL's batch sizes no slice longer than SLICE_BLOCKS blocks
    of Qwen's vocabulary (long unrolled slices were slow at 256 rows)."""
    monkeypatch.setattr(sampling, "num_sms", lambda device: 132)
    vocab = 152064
    slices = sampling._slices(rows, vocab, torch.device("cpu"), sampling.BLOCK)
    blocks = -(-vocab // sampling.BLOCK)
    assert 1 <= slices <= sampling.MAX_SLICES
    assert -(-blocks // slices) <= sampling.SLICE_BLOCKS
    assert rows * slices >= min(4 * 132, rows * sampling.MAX_SLICES) * 0.9


def test_a_seed_repeats_its_draws_and_another_does_not():
    seed = fresh_seed()
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(seed)).to(device())
    first = sampling.sample(logits, 1.0, generator(seed))[0]
    assert torch.equal(first, sampling.sample(logits, 1.0, generator(seed))[0])
    assert not torch.equal(first, sampling.sample(logits, 1.0, generator(seed + 1))[0])


def test_bad_logits_are_refused():
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        sampling.sample(torch.randn(4), 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        sampling.sample(torch.randn(8, 4).t(), 1.0)
    with pytest.raises(ValueError, match="temperature"):
        sampling.sample(torch.randn(2, 4), -1.0)
    with pytest.raises(ValueError, match="power of two of at least 4"):
        sampling.sample(torch.randn(2, 4), 1.0, block=2)
