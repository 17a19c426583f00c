"""The log-probability term of the footprint (qerl.rl.footprint): TRL's fused LM head, which
the trainer's every forward goes through, scores tokens in tiles of the sizes the footprint
counts, and its tiled log-probabilities and their gradients equal the whole [tokens x
vocab] computation (float64) for tile sizes that divide nothing."""

from __future__ import annotations

import pytest
import torch
from trl.kernels import chunked_logprob
from trl.trainer import utils as trl_utils

from qerl.rl import footprint
from tests.conftest import fresh_seed


def test_the_footprint_counts_trls_tiles():
    assert footprint.TOKEN_TILE == chunked_logprob.TOKEN_CHUNK_SIZE
    assert footprint.VOCAB_TILE == trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE


@pytest.mark.parametrize(("token_tile", "vocab_tile"), [(5, 7), (3, 33), (64, 97), (1, 1)])
def test_tiled_log_probs_equal_the_whole_softmax(monkeypatch, token_tile, vocab_tile):
    monkeypatch.setattr(chunked_logprob, "TOKEN_CHUNK_SIZE", token_tile)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden, vocab = 23, 12, 97
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64) * 2
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    labels = torch.randint(vocab, (tokens,), generator=gen)
    grad = torch.randn(tokens, generator=gen, dtype=torch.float64)
    h_tiled, w_tiled = h.clone().requires_grad_(), w.clone().requires_grad_()
    logprobs, *_ = chunked_logprob.ChunkedLogProbFunction.apply(
        h_tiled, w_tiled, None, labels, 1.0, vocab_tile, None, 1.0, ("log_probs",))
    (logprobs * grad).sum().backward()
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    expected = torch.log_softmax(h_ref @ w_ref.T, dim=-1).gather(1, labels[:, None])[:, 0]
    (expected * grad).sum().backward()
    # The running statistics are fp32: float32's rounding over a sum of `vocab` terms, on
    # values and gradients up to ~10 (so relative as well as absolute).
    bound = vocab * torch.finfo(torch.float32).eps
    close = {"atol": bound, "rtol": bound, "msg": lambda m: f"seed {seed}: {m}"}
    torch.testing.assert_close(logprobs.detach().double(), expected.detach(), **close)
    torch.testing.assert_close(h_tiled.grad.double(), h_ref.grad, **close)
    torch.testing.assert_close(w_tiled.grad.double(), w_ref.grad, **close)


@pytest.mark.parametrize("arch", ["qwen2.5-7b", "qwen2.5-32b"])
def test_the_kv_term_is_what_the_engine_allocates_and_fp8_halves_it(arch):
    """The footprint's KV cache is the engine's own count (KVCache.bytes_per_sequence) for
    both formats: fp8 is half of bf16's bytes plus its scales; nothing else changes."""
    import torch

    from qerl.archs import config_for
    from qerl.rollout.decoder import KVCache

    config = config_for(arch)
    sequences, prompt_len, completion = 48, 256, 1024
    terms = {kv: footprint.step_memory(config, footprint.Step(
        "qerl", sequences, 4, prompt_len, completion, kv_cache=kv)) for kv in ("bf16", "fp8")}
    for kv, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        engine_bytes = sequences * KVCache.bytes_per_sequence(config, prompt_len + completion,
                                                              dtype)
        assert terms[kv]["kv_cache"] == pytest.approx(engine_bytes / footprint.GB, rel=1e-12)
    scales = sequences * config.num_hidden_layers * 2 * config.num_key_value_heads * 4
    assert terms["fp8"]["kv_cache"] == pytest.approx(
        terms["bf16"]["kv_cache"] / 2 + scales / footprint.GB, rel=1e-12)
    saved = terms["bf16"]["kv_cache"] - terms["fp8"]["kv_cache"]
    assert terms["fp8"]["total"] == pytest.approx(terms["bf16"]["total"] - saved, rel=1e-12)
    assert {k: v for k, v in terms["fp8"].items() if k not in ("kv_cache", "total")} == {
        k: v for k, v in terms["bf16"].items() if k not in ("kv_cache", "total")}
    with pytest.raises(ValueError, match="the footprint models the KV caches"):
        footprint.Step("qerl", 1, 1, 1, 1, kv_cache="int8")
