"""Causal attention over left- and right-padded batches without a mask.

A GRPO batch is [prompt, left-padded | completion, right-padded after its stop]. With a
padding mask, SDPA leaves its flash kernels for ones that read every key of every row (no
causal skipping, the key/value heads repeated for the query heads first), so one early stop
in a batch makes the whole train phase markedly slower. But each
row's real tokens are one contiguous run, so rotating the row left by its left padding puts
the run first and all padding after it, where causal attention never lets a real token see
it: one mask-free causal SDPA (its flash path), rotated back. Positions are untouched (the
rotary embedding is applied before), so real tokens get the same result; padding positions
get other values, which nothing reads.

Registered with transformers as the attention implementation "qerl_sdpa", with the
"sdpa" mask. Any other call (a KV cache longer than the queries, a mask that is not causal
over one run per row, sliding windows, a position bias) goes to the stock "sdpa". The
rollout engine's prefill calls ``causal_over_runs`` itself, with the padding it knows.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "qerl_sdpa"

# The last mask checked, and its answer: every layer of a forward (and its recompute under
# gradient checkpointing) gets the same mask object, which is checked once, with one wait
# for the GPU. A weak reference: a new mask at a freed one's address is not mistaken for it.
_checked: tuple[weakref.ref, torch.Tensor | None, bool] | None = None


def left_padding(mask: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """(each row's left padding, whether any row has some) if the boolean mask [B, 1, T, T]
    is causal over one contiguous run of real keys per row (rows of padding queries
    aside); else (None, False)."""
    global _checked
    if _checked is not None and _checked[0]() is mask:
        return _checked[1], _checked[2]
    keys = mask[:, 0, -1, :]  # the last query sees every real key
    t = keys.shape[-1]
    pos = torch.arange(t, device=mask.device)
    first = keys.int().argmax(-1)  # 0 for a row without real keys
    last = first + keys.sum(-1)
    run = (pos >= first[:, None]) & (pos < last[:, None])
    expected = (pos[:, None] >= pos[None, :]) & keys[:, None, :]
    ok = (run == keys).all() & ((mask[:, 0] == expected) | ~keys[:, :, None]).all()
    shifts, any_shift = (first, bool(first.any())) if bool(ok) else (None, False)
    _checked = (weakref.ref(mask), shifts, any_shift)
    return shifts, any_shift


def _rotated(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] with row b's tokens taken at index[b] [T]."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0,
              scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """A transformers attention function (see the module docstring)."""
    t = query.shape[2]
    shifts = None
    if (attention_mask is not None and attention_mask.dtype == torch.bool
            and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
            and key.shape[2] == t > 1 and attention_mask.shape[-2:] == (t, t)
            and getattr(module, "is_causal", True) and is_causal is not False
            and kwargs.get("sliding_window") is None and kwargs.get("position_bias") is None):
        shifts, any_shift = left_padding(attention_mask)
    if shifts is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    out = causal_over_runs(query, key, value, shifts if any_shift else None, scaling, dropout)
    return out.transpose(1, 2).contiguous(), None


def causal_over_runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     shifts: torch.Tensor | None, scale: float | None, dropout: float = 0.0
                     ) -> torch.Tensor:
    """Causal attention [B, H, T, D] of rows whose real tokens are one run from their left
    padding ``shifts`` [B] (None: none) to the right padding, if any: rotated left by their
    padding, one mask-free causal SDPA, rotated back (the module docstring). Padding
    queries get finite values that nothing should read."""
    t = query.shape[2]
    if shifts is not None:
        pos = torch.arange(t, device=query.device)
        take = (pos[None, :] + shifts[:, None]) % t
        query, key, value = (_rotated(x, take) for x in (query, key, value))
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scale,
                                         is_causal=True,
                                         enable_gqa=query.shape[1] != key.shape[1])
    if shifts is not None:
        out = _rotated(out, (pos[None, :] - shifts[:, None]) % t)
    return out


def use_padded_attention(model) -> None:
    """Make ``model`` (a transformers model, or one wrapping it) attend with ``attention``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
