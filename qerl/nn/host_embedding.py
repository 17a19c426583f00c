"""An input embedding whose table stays in host memory: the GPU holds only the rows a
forward gathers (kernels/host_embedding.py reads them from pinned memory over PCIe).

LoRA training leaves the input embedding frozen, and the decoder reads only the rows of the
tokens it sees, so the table need not occupy GPU memory. ``HostEmbedding`` keeps it as a
pinned host buffer named ``weight``: ``state_dict()`` still holds
``model.embed_tokens.weight`` and ``get_input_embeddings().weight`` its values and dtype,
while ``model.parameters()`` no longer yields it, so the model's device is read from a
parameter (``next(model.parameters()).device``, transformers' ``model.device``), not from
the embedding's weight. ``model.to(...)`` moves and casts what the embedding computes, not
the table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qerl.errors import QerlError
from qerl.kernels.host_embedding import gather_rows


class HostEmbeddingError(QerlError, ValueError):
    """An input embedding cannot live in host memory (it is trained, or tied to the LM
    head, or does more than gather rows)."""


def _host_table(weight: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``weight`` in host memory, pinned where a GPU will read it (a copy unless it is
    there already)."""
    weight = weight.detach()
    if device.type == "cpu" or weight.is_pinned():
        # Host memory already; pinning needs CUDA, and a CPU forward reads any memory.
        return weight.cpu()
    # Straight into pinned memory: .cpu().pin_memory() would hold two host copies.
    table = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=True)
    return table.copy_(weight)


def _normalized(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class HostEmbedding(nn.Module):
    """``forward(ids)`` -> the rows of ids [*ids.shape, embedding_dim] on ``device``, in
    ``dtype``: the frozen table ``weight`` [num_embeddings, embedding_dim] is a buffer in
    host memory (pinned when ``device`` is a GPU). ``device`` and ``dtype`` follow the
    model's ``.to()``/``.cuda()``/``.float()``, as an ``nn.Embedding``'s weight would; the
    table stays where and what it is. No gradient reaches the table; the output can be
    made to require grad (transformers' ``enable_input_require_grads``)."""

    def __init__(self, weight: torch.Tensor, device: torch.device | str,
                 padding_idx: int | None = None):
        super().__init__()
        self.device = _normalized(device)
        table = _host_table(weight, self.device)
        self.dtype = table.dtype
        self.num_embeddings, self.embedding_dim = table.shape
        self.padding_idx = padding_idx
        self.register_buffer("weight", table)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, device: torch.device | str) -> HostEmbedding:
        """``emb``'s table moved to host memory, its rows computed on ``device``."""
        if type(emb) is not nn.Embedding:
            # A subclass (Gemma's scaled embedding, PEFT's trainable-token wrapper) does more
            # in forward than gather rows; that would be lost.
            raise HostEmbeddingError(f"only a plain nn.Embedding can move to host memory, "
                                     f"not {type(emb).__name__}")
        if emb.max_norm is not None:
            raise HostEmbeddingError("an nn.Embedding with max_norm renormalizes its table in "
                                     "place; it cannot move to host memory")
        return cls(emb.weight, device, emb.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.device != self.device:
            raise HostEmbeddingError(f"the ids are on {ids.device}; the embedding computes on "
                                     f"{self.device}")
        if self.device.type == "cpu":
            rows = F.embedding(ids, self.weight, self.padding_idx)
            return rows if rows.dtype == self.dtype else rows.to(self.dtype)
        return gather_rows(self.weight, ids, self.dtype)

    def _apply(self, fn, recurse=True):
        # nn.Module's _apply would move and cast the table with the model: onto the GPU,
        # undoing the memory this module saves, or into a pageable copy that a GPU kernel
        # cannot read. The table stays; what the rows are computed on and in follows fn,
        # read off an empty tensor that stands for the weight nn.Embedding would have.
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        self.device, self.dtype = _normalized(probe.device), probe.dtype
        if self.device.type == "cuda" and not self.weight.is_pinned():
            # Built on a CPU model, now moved to a GPU: one pinned copy, the old one freed.
            self.weight = _host_table(self.weight, self.device)
        return self

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, table in host memory, "
                f"rows on {self.device}" + (f", padding_idx={self.padding_idx}"
                                            if self.padding_idx is not None else ""))


def embedding_to_host(model: nn.Module) -> HostEmbedding:
    """Replace the input embedding of a transformers CausalLM (or a PEFT model around one)
    by a ``HostEmbedding`` that computes on the embedding's device, and return it. Call it
    once the embedding is frozen (after PEFT wrapped the model). Forward hooks on the old
    embedding (``enable_input_require_grads``'s) carry over, their handles still valid."""
    emb = model.get_input_embeddings()
    config = model.config
    head = model.get_output_embeddings()
    if getattr(config, "tie_word_embeddings", False) or (
            head is not None and head.weight is getattr(emb, "weight", None)):
        raise HostEmbeddingError("the model ties its word embeddings (tie_word_embeddings): "
                                 "the LM head shares the table, which must stay on the GPU")
    if isinstance(emb, nn.Embedding) and emb.weight.requires_grad:
        raise HostEmbeddingError("the input embedding's weight requires grad (a full "
                                 "fine-tune trains it): only a frozen table moves to host "
                                 "memory")
    host = HostEmbedding.from_embedding(emb, emb.weight.device)
    # The same dicts, not copies: a hook's handle removes it from the dict it was made in.
    for hooks in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        setattr(host, hooks, getattr(emb, hooks))
    model.set_input_embeddings(host)
    return host
