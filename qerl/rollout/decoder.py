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

An fp8 cache (qerl/formats/kv_cache.py) gets its scales from the prefill and is written
at them by every step; attention, prefill and decode alike, reads the keys and values
dequantized, the same numbers either way.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from qerl.formats import kv_cache
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
    each sequence; an fp8 cache also holds the scale of each (layer, sequence, kv head)'s
    keys and values [layers, batch, kv_heads] (fp32)."""

    k: torch.Tensor
    v: torch.Tensor
    pad: torch.Tensor  # [batch] int64
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @staticmethod
    def bytes_per_slot(config, dtype: torch.dtype) -> int:
        """Bytes one token of one sequence takes in a cache of ``dtype``."""
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim_of(
            config) * item

    @classmethod
    def bytes_per_sequence(cls, config, slots: int, dtype: torch.dtype) -> int:
        """Bytes one sequence of ``slots`` tokens takes in a cache of ``dtype`` (an fp8
        one's scales included)."""
        scales = 2 * config.num_hidden_layers * config.num_key_value_heads if kv_cache.is_fp8(
            dtype) else 0
        return slots * cls.bytes_per_slot(config, dtype) + scales * kv_cache.SCALE_BYTES

    @classmethod
    def allocate(cls, config, batch: int, slots: int, dtype, device) -> KVCache:
        shape = (config.num_hidden_layers, batch, config.num_key_value_heads, slots,
                 head_dim_of(config))
        scales = [None, None]
        if kv_cache.is_fp8(dtype):  # 1 until a prefill sets them
            scales = [torch.ones(shape[:3], device=device) for _ in range(2)]
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device), *scales)

    def rows(self, rows, slots: int) -> KVCache:
        """The cache of sequences ``rows`` (a slice), their first ``slots`` slots."""
        return KVCache(self.k[:, rows, :, :slots], self.v[:, rows, :, :slots], self.pad[rows],
                       *(s[:, rows] for s in self.scales))

    @property
    def scales(self) -> tuple[torch.Tensor, ...]:
        """(k_scale, v_scale) of an fp8 cache; () of another."""
        return () if self.k_scale is None else (self.k_scale, self.v_scale)

    def layer_scales(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s scales as the kernels take them: {} for a cache that has none."""
        return {} if self.k_scale is None else {"k_scale": self.k_scale[i],
                                                 "v_scale": self.v_scale[i]}

    def read(self, i: int, slots: int, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values of the first ``slots`` slots as attention reads
        them: as they are, or dequantized to ``dtype``."""
        k, v = self.k[i][:, :, :slots], self.v[i][:, :, :slots]
        if self.k_scale is None:
            return k, v
        return (kv_cache.dequantize(k, self.k_scale[i], dtype),
                kv_cache.dequantize(v, self.v_scale[i], dtype))


def head_dim_of(config) -> int:
    """The attention heads' size of a transformers config."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def fused_norm(norm: nn.Module) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of a Qwen2/Llama RMSNorm that the fused kernel computes exactly as its
    forward does (AQN's output cast is the only hook it reproduces), else None."""
    hooks = [h for h in norm._forward_hooks.values() if h is not output_in_input_dtype]
    if not is_rms_norm(norm) or hooks or norm._forward_pre_hooks:
        return None
    return norm.weight, norm.variance_epsilon


class Decoder(nn.Module):
    """``forward(ids [B, T], first_slot, cache, prefill)`` -> logits of the last position
    [B, V], writing slots first_slot .. first_slot + T - 1 of the cache: a prefill (the
    sequences' first forward, first_slot 0; it fixes an fp8 cache's scales) or a decode step
    (T = 1).

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

    def forward(self, ids: torch.Tensor, first_slot: torch.Tensor, cache: KVCache,
                prefill: bool = False) -> torch.Tensor:
        steps = ids.shape[1]
        slots = first_slot + torch.arange(steps, device=ids.device)  # [T]
        positions = (slots[None, :] - cache.pad[:, None]).clamp_min(0)  # [B, T]
        # [B, T]: the prompts' tokens, whose keys and values set an fp8 cache's scales
        real = slots[None, :] >= cache.pad[:, None] if prefill and cache.scales else None
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
            attn = self._attention(layer.self_attn, x, i, slots, visible, shifts, real, cos,
                                   sin, cache)
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

    def _attention(self, attn, x, i, slots, visible, shifts, real, cos, sin, cache):
        batch, steps, _ = x.shape
        q, k, v = self._project([attn.q_proj, attn.k_proj, attn.v_proj], x)
        if real is not None:  # an fp8 cache's prefill: the scales of its keys and values
            heads = (batch, steps, self.kv_heads, self.head_dim)
            for scale, new in zip(cache.scales, kv_cache.prefill_scales(
                    k.view(heads), v.view(heads), real), strict=True):
                scale[i].copy_(new)
        if not cache.scales:
            k, v = k.to(cache.k.dtype), v.to(cache.v.dtype)
        scales = cache.layer_scales(i)
        if self.fused:
            q = rotary_into_cache(q, k, v, cos, sin, cache.k[i], cache.v[i], slots, **scales)
        else:
            q = reference_rotary_into_cache(q, k, v, cos, sin, cache.k[i], cache.v[i], slots,
                                            self._apply_rotary, **scales)
        if steps > 1:  # a prefill: the keys are its own tokens'
            out = causal_over_runs(q, *cache.read(i, steps, q.dtype), shifts, self.scaling)
        elif visible is None:
            out = decode_attention.decode_attention(q, cache.k[i], cache.v[i], cache.pad,
                                                    slots[0], self.scaling, **scales)
        else:
            out = F.scaled_dot_product_attention(q, *cache.read(i, cache.k.shape[3], q.dtype),
                                                 attn_mask=visible, scale=self.scaling,
                                                 enable_gqa=self.heads != self.kv_heads)
        return self._project([attn.o_proj], out.transpose(1, 2).reshape(batch, steps, -1))[0]
