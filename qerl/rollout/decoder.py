"""A decoder forward over a live Hugging Face Qwen2/Llama model with a static KV cache.

It calls the model's own modules — embeddings, norms (AQN's noise included), the
projections (NVFP4 kernels or BF16, LoRA unmerged through PEFT) and lm_head — so rollouts
always sample from the weights being trained: nothing is copied, nothing goes stale. Only
the attention plumbing is ours: one preallocated cache, written at fixed slots, so that a
decode step has static shapes and can be replayed from a CUDA graph.

Batches are left-padded to a common prompt length P: slot s of sequence b holds its token
at position s - pad[b]; decode step t writes slot P + t for every sequence. Attention sees
slots pad[b] <= s <= the current one (as Hugging Face's generate does with an attention
mask, whose position ids are the same). The prefill (a forward of several tokens, from slot
0) attends over its own tokens with qerl/nn/padded_attention.py's mask-free causal SDPA,
which keeps SDPA's flash kernels that a padding mask would cost.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from qerl.kernels import decode_attention
from qerl.kernels.rmsnorm import rms_norm
from qerl.kernels.rotary_cache import reference_rotary_into_cache, rotary_into_cache
from qerl.nn.liger import is_rms_norm, is_swiglu_mlp
from qerl.nn.padded_attention import causal_over_runs
from qerl.noise import output_in_input_dtype
from qerl.rollout.projections import merge_dense, project


@dataclass
class KVCache:
    """Keys and values [layers, batch, kv_heads, slots, head_dim] and the left padding of
    each sequence."""

    k: torch.Tensor
    v: torch.Tensor
    pad: torch.Tensor  # [batch] int64

    @staticmethod
    def bytes_per_slot(config, dtype: torch.dtype) -> int:
        """Bytes one token of one sequence takes in the cache."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * item

    @classmethod
    def allocate(cls, config, batch: int, slots: int, dtype, device) -> KVCache:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        shape = (config.num_hidden_layers, batch, config.num_key_value_heads, slots, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device))


def fused_norm(norm: nn.Module) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of a Qwen2/Llama RMSNorm that the fused kernel computes exactly as its
    forward does (AQN's output cast is the only hook it reproduces), else None."""
    hooks = [h for h in norm._forward_hooks.values() if h is not output_in_input_dtype]
    if not is_rms_norm(norm) or hooks or norm._forward_pre_hooks:
        return None
    return norm.weight, norm.variance_epsilon


class Decoder(nn.Module):
    """``forward(ids [B, T], first_slot)`` -> logits of the last position [B, V], writing
    slots first_slot .. first_slot + T - 1 of the cache: a prefill (T > 1, first_slot 0)
    or a decode step (T = 1).

    ``fused`` (on CUDA, or under Triton's interpreter) runs the glue between the matmuls
    as our kernels — RMSNorm with the residual add, rotary with the cache write, LoRA in
    two launches per input (kernels/, qerl/rollout/projections.py), and a decode step's
    attention split over the cache's live slots (kernels/decode_attention.py) — which a
    decode step, a few rows, would otherwise spend ~200 launches per layer on, and SDPA
    one program per sequence and kv head. Unfused, every piece is the model's own module:
    the reference the fused step is tested against."""

    def __init__(self, model: nn.Module, fused: bool = False):
        super().__init__()
        self.model = model  # the transformers CausalLM (LoRA layers injected, if any)
        self.fused = fused
        inner = model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        # Frozen dense q/k/v and gate/up as one GEMM each (views: no memory added). Every
        # engine merges, fused or not, before it captures a graph: an engine's graphs must
        # never hold the storage a later merge frees.
        for layer in self.layers:
            attn = layer.self_attn
            merge_dense([attn.q_proj, attn.k_proj, attn.v_proj])
            if is_swiglu_mlp(layer.mlp):
                merge_dense([layer.mlp.gate_proj, layer.mlp.up_proj])
        # The model family's own rotary application, for bit-identical numbers.
        self._apply_rotary = importlib.import_module(type(model).__module__).apply_rotary_pos_emb
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads

    def forward(self, ids: torch.Tensor, first_slot: torch.Tensor, cache: KVCache
                ) -> torch.Tensor:
        steps = ids.shape[1]
        slots = first_slot + torch.arange(steps, device=ids.device)  # [T]
        positions = (slots[None, :] - cache.pad[:, None]).clamp_min(0)  # [B, T]
        visible = None  # a decode step's fused attention reads pad and the slot itself
        shifts = None  # a prefill's: each row's left padding, None if no row has any
        if steps > 1:
            shifts = cache.pad if bool(cache.pad.any()) else None
        elif not (self.fused and decode_attention.supports(self.head_dim)):
            all_slots = torch.arange(cache.k.shape[3], device=ids.device)
            # [B, 1, 1, S]: the step's query at slot q sees slots pad <= s <= q.
            s, q = all_slots[None, None, :], slots[None, :, None]
            visible = ((s <= q) & (s >= cache.pad[:, None, None]))[:, None]
        h = self.embed(ids)
        cos, sin = self.rotary(h, positions)
        delta = None  # the last block's output, added to h by the next norm
        for i, layer in enumerate(self.layers):
            x, h = self._norm(layer.input_layernorm, h, delta)
            attn = self._attention(layer.self_attn, x, i, slots, visible, shifts, cos, sin,
                                   cache)
            x, h = self._norm(layer.post_attention_layernorm, h, attn)
            delta = self._mlp(layer.mlp, x)
        x, _ = self._norm(self.norm, h[:, -1:], delta[:, -1:])
        return self.lm_head(x)[:, 0]

    def _norm(self, norm, h, delta):
        """(norm(h + delta), h + delta)."""
        fused = fused_norm(norm) if self.fused else None
        if fused is not None:
            return rms_norm(h, *fused, residual=delta)
        if delta is not None:
            h = h + delta
        return norm(h), h

    def _project(self, modules, x, silu_mul: bool = False):
        rows = x.reshape(-1, x.shape[-1])
        outs = project(modules, rows, silu_mul) if self.fused else [m(rows) for m in modules]
        return [out.view(*x.shape[:-1], -1) for out in outs]

    def _mlp(self, mlp, x):
        if self.fused and is_swiglu_mlp(mlp):
            act = self._project([mlp.gate_proj, mlp.up_proj], x, silu_mul=True)[0]
        else:
            gate, up = self._project([mlp.gate_proj, mlp.up_proj], x)
            act = mlp.act_fn(gate) * up
        return self._project([mlp.down_proj], act)[0]

    def _attention(self, attn, x, i, slots, visible, shifts, cos, sin, cache):
        batch, steps, _ = x.shape
        q, k, v = self._project([attn.q_proj, attn.k_proj, attn.v_proj], x)
        k, v = k.to(cache.k.dtype), v.to(cache.v.dtype)
        if self.fused:
            q = rotary_into_cache(q, k, v, cos, sin, cache.k[i], cache.v[i], slots)
        else:
            q = reference_rotary_into_cache(q, k, v, cos, sin, cache.k[i], cache.v[i], slots,
                                            self._apply_rotary)
        if steps > 1:  # a prefill: the keys are its own tokens'
            out = causal_over_runs(q, cache.k[i][:, :, :steps], cache.v[i][:, :, :steps],
                                   shifts, self.scaling)
        elif visible is None:
            out = decode_attention.decode_attention(q, cache.k[i], cache.v[i], cache.pad,
                                                    slots[0], self.scaling)
        else:
            out = F.scaled_dot_product_attention(q, cache.k[i], cache.v[i], attn_mask=visible,
                                                 scale=self.scaling,
                                                 enable_gqa=self.heads != self.kv_heads)
        return self._project([attn.o_proj], out.transpose(1, 2).reshape(batch, steps, -1))[0]
