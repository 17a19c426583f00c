"""Mask-free causal attention over padded batches: the same logits and gradients at real
tokens as transformers' SDPA with the padding mask; any other mask goes to the stock path."""

from __future__ import annotations

import copy

import pytest
import torch

from qerl.nn import padded_attention
from qerl.nn.padded_attention import use_padded_attention
from tests.conftest import fresh_seed, tiny_config


def pair(seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    stock = AutoModelForCausalLM.from_config(tiny_config(), attn_implementation="sdpa",
                                             dtype=torch.float32)
    ours = copy.deepcopy(stock)
    use_padded_attention(ours)
    return stock, ours


def batch(seed: int, lefts, rights, t=13, vocab=64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lefts), t), generator=g)
    mask = torch.ones_like(ids)
    for row, (left, right) in enumerate(zip(lefts, rights, strict=True)):
        mask[row, :left] = 0
        mask[row, t - right:] = 0
    return ids, mask


def run(model, ids, mask):
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    logits[real].sum().backward()
    return logits.detach()[real], model.model.embed_tokens.weight.grad.clone()


@pytest.mark.parametrize(("lefts", "rights"), [([0, 3, 5], [2, 0, 4]), ([0, 0], [0, 6]),
                                               ([4, 1], [0, 0])])
def test_padded_batches_match_the_masked_sdpa(lefts, rights):
    seed = fresh_seed()
    stock, ours = pair(seed)
    ids, mask = batch(seed, lefts, rights)
    (l1, g1), (l2, g2) = run(stock, ids, mask), run(ours, ids, mask)
    assert torch.allclose(l1, l2, atol=1e-5, rtol=1e-5), f"seed {seed}"
    # An embedding row's gradient sums terms up to ~100x its own size: fp32 summed in another
    # order leaves an error of the large terms' rounding (seen: 1.6e-5 on 0.31, max 155).
    scale = g1.abs().max().item()
    assert torch.allclose(g1, g2, atol=1e-6 * scale, rtol=1e-5), f"seed {seed}"
    assert padded_attention._checked is not None and padded_attention._checked[1] is not None


def test_other_masks_take_the_stock_path_bit_for_bit():
    """A hole inside a row is not padding the rotation can move: the stock masked SDPA."""
    seed = fresh_seed()
    stock, ours = pair(seed)
    ids, mask = batch(seed, [1, 0], [0, 2])
    mask[0, 6] = 0
    assert torch.equal(run(stock, ids, mask)[0], run(ours, ids, mask)[0]), f"seed {seed}"
    assert padded_attention._checked[1] is None


def test_generation_with_a_cache_is_unchanged():
    seed = fresh_seed()
    stock, ours = pair(seed)
    ids, mask = batch(seed, [3, 0], [0, 0], t=9)
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(stock.generate(input_ids=ids, attention_mask=mask, **kwargs),
                           ours.generate(input_ids=ids, attention_mask=mask, **kwargs))
