"""The engine's fp8 KV cache (``kv_cache="fp8"``, qerl/formats/kv_cache.py): log-probs within
the quantization's reach of the model's own, a prefill and the decode steps reading the
same cache, the scales carried wherever rows move, its bytes counted where a budget sizes
it, and bad requests refused by name."""

from __future__ import annotations

import pytest
import torch

from qerl.formats import kv_cache
from qerl.rollout import Engine, RolloutError, SamplingParams
from qerl.rollout.decoder import KVCache
from tests.conftest import fresh_seed, tiny_config
from tests.rollout.test_engine import PROMPTS, forward_logprobs, tiny

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("fused", [False, True], ids=["modules", "kernels"])
def test_log_probs_stay_within_the_quantizations_reach_of_the_models_own(fused):
    """Sampled with an fp8 cache, each token's log-prob against the model's own forward
    (fp32; an fp32 cache, the default format's role on this CPU, gives the forward's within
    1e-4: test_engine). E4M3 rounds each key and value to 3 mantissa bits, within 2^-4 of
    itself; on these tiny random models that moved a log-prob by at most 0.015 nats and
    0.0036 on average (300 seeds, the models' own modules; the kernels' alike on 10). The
    bounds, 0.05 and 0.01, leave a factor of about 3; a wrong scale or a saturated head
    moves log-probs by whole nats."""
    seed = fresh_seed()
    model = tiny("qwen2" if seed % 2 else "llama", torch.float32, seed)
    engine = Engine(model, max_batch=4, max_seq_len=24, fused=fused, kv_cache="fp8")
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5 if fused else 8,
                                                  temperature=1.0, seed=seed))
    assert engine.cache.k.dtype == FP8
    diff = torch.cat([(torch.tensor(lp) - forward_logprobs(model, p, t)).abs()
                      for p, t, lp in zip(PROMPTS, out.tokens, out.logprobs, strict=True)])
    assert diff.max() < 0.05 and diff.mean() < 0.01, (seed, diff.tolist())
    assert diff.max() > 0, seed  # the cache is quantized


def test_a_prefill_and_the_decode_steps_read_the_same_fp8_cache():
    """Tokens decoded one step at a time, then the same tokens given to one forward at the
    scales the rollout's prefill set: each token's log-prob is the decode step's, to the
    fp32 the engine returns them in (a float64 model: its projections, whichever rows they
    run with, round no key to another E4M3 value). Both write the same bytes and attend
    over the same dequantized keys and values."""
    seed = fresh_seed()
    model = tiny("qwen2", torch.float64, seed)
    engine = Engine(model, max_batch=4, max_seq_len=24, kv_cache="fp8")
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0,
                                                  seed=seed))
    scales = [s.clone() for s in engine.cache.scales]  # [L, B, KVH]: row b is PROMPTS[b]
    whole = Engine(model, max_batch=1, max_seq_len=24, kv_cache="fp8")
    for b, (prompt, tokens, logprobs) in enumerate(zip(PROMPTS, out.tokens, out.logprobs,
                                                       strict=True)):
        for t in range(1, len(tokens)):
            ids = torch.tensor([prompt + tokens[:t]])
            cache = whole._view(1, ids.shape[1])
            for part, scale in zip(cache.scales, scales, strict=True):
                part.copy_(scale[:, b:b + 1])
            with torch.no_grad():  # a forward of several tokens, its scales kept
                logits = whole.decoder(ids, torch.zeros((), dtype=torch.long), cache)
            logprob = torch.log_softmax(logits[0], -1)[tokens[t]].item()
            assert logprob == pytest.approx(logprobs[t], abs=1e-6), (seed, b, t)


def test_a_repeated_prompt_takes_its_scales_to_every_repeat():
    """A prompt prefilled once and its rows copied to its repeats: the rollout of an engine
    that prefills every row (float64: the same keys whichever rows a projection runs)."""
    seed = fresh_seed()
    model = tiny("llama", torch.float64, seed)
    a, b, c = PROMPTS
    prompts = [a, a, b, c, a, b]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed)
    each = Engine(model, max_batch=8, max_seq_len=24, kv_cache="fp8",
                  share_prompts=False).generate(prompts, params)
    shared = Engine(model, max_batch=8, max_seq_len=24, kv_cache="fp8").generate(prompts,
                                                                                  params)
    assert shared.tokens == each.tokens, seed
    for x, y in zip(shared.logprobs, each.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=0, atol=1e-6)


def test_moved_rows_take_their_scales_along():
    """What compaction and shared prompts do to the cache: rows [2, 0, 0] become the first
    three, their first slots' bytes, padding and scales alike; the rest stays."""
    gen = torch.Generator().manual_seed(fresh_seed())
    engine = Engine(tiny("qwen2", torch.float32, 0), max_batch=4, max_seq_len=8,
                    kv_cache="fp8")
    cache = engine.cache
    for part in (cache.k, cache.v):
        part.copy_(torch.randn(part.shape, generator=gen).to(FP8))
    for part in cache.scales:
        part.copy_(torch.exp2(torch.randint(-5, 5, part.shape, generator=gen).float()))
    cache.pad.copy_(torch.tensor([3, 1, 4, 1]))
    before = KVCache(*(t.clone() for t in (cache.k, cache.v, cache.pad, *cache.scales)))
    engine._move_rows(torch.tensor([2, 0, 0]), slots=5)
    rows = torch.tensor([2, 0, 0, 3])
    for got, old in ((cache.k, before.k), (cache.v, before.v)):
        assert torch.equal(got[:, :, :, :5].view(torch.uint8),
                           old[:, rows, :, :5].view(torch.uint8))
        assert torch.equal(got[:, :, :, 5:].view(torch.uint8), old[:, :, :, 5:].view(torch.uint8))
    for got, old in zip(cache.scales, before.scales, strict=True):
        assert torch.equal(got, old[:, rows])
    assert cache.pad.tolist() == [4, 3, 3, 1]


def test_a_budget_holds_the_sequences_their_fp8_bytes_and_scales_allow():
    """One byte a key or value element and two fp32 scales per (layer, kv head) a sequence:
    what the engine counts is what it allocates, and a budget holds that many sequences."""
    config = tiny_config()
    layers, kv_heads, head_dim = 2, 2, 16
    per_sequence = 2 * layers * kv_heads * (100 * head_dim * 1 + kv_cache.SCALE_BYTES)
    assert KVCache.bytes_per_sequence(config, 100, FP8) == per_sequence
    assert KVCache.bytes_per_sequence(config, 100, torch.bfloat16) == 100 * 2 * layers * (
        kv_heads * head_dim * 2)
    allocated = KVCache.allocate(config, 3, 100, FP8, "cpu")
    assert sum(t.nbytes for t in (allocated.k, allocated.v, *allocated.scales)) == (
        3 * per_sequence)
    assert (allocated.k_scale == 1).all() and (allocated.v_scale == 1).all()
    model = tiny("qwen2", torch.float32, 0)
    assert Engine.max_batch_for(config, 5 * per_sequence + 1, 100, torch.float32,
                                "fp8") == 5
    assert Engine.for_budget(model, 5 * per_sequence + 1, 100, kv_cache="fp8").max_batch == 5
    with pytest.raises(RolloutError, match="over the budget .* holds 5 sequences"):
        Engine(model, max_batch=6, max_seq_len=100, kv_budget_bytes=5 * per_sequence + 1,
               kv_cache="fp8")


def test_bad_kv_cache_requests_are_refused_by_name(monkeypatch):
    model = tiny("qwen2", torch.float32, 0)
    with pytest.raises(RolloutError, match="engine.kv_cache is one of bf16, fp8, not 'fp4'"):
        Engine(model, max_batch=1, max_seq_len=8, kv_cache="fp4")
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(RolloutError, match="engine.kv_cache fp8 stores torch.float8_e4m3fn, "
                                           "which torch .* does not have"):
        Engine(model, max_batch=1, max_seq_len=8, kv_cache="fp8")
