"""The rollout's sampling settings (``SamplingParams``: temperature, top-k, top-p, stop
tokens, seed) and how a step applies them to its logits (``sample``, with the
log-probabilities RL needs): torch's ops, or in the engine's fused step, where nothing
truncates, the fused kernel (kernels/sampling.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl.errors import QerlError
from qerl.kernels import sampling as sampling_kernels


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 are off. ``stop_token_ids``
    end a sequence (the stop token is kept); ``ignore_eos`` runs every sequence to
    ``max_new_tokens`` (benchmarks). ``seed`` makes sampling reproducible."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise QerlError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise QerlError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise QerlError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise QerlError(f"top_k must be >= 0, got {self.top_k}")


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None, fused: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], log-probabilities [B]).

    The log-probability is the token's under the temperature-scaled distribution before
    top-k/top-p truncation: what a trainer recomputes from its own forward pass (TRL divides
    the logits by the temperature and takes the full log-softmax). Greedy returns the plain
    log-softmax. ``fused`` (the engine's fused decode step) draws untruncated samples with
    our two-launch kernel (kernels/sampling.py) instead of ~20 torch kernels; the same
    distribution, from another stream of random numbers."""
    if fused and params.top_k == 0 and params.top_p == 1:
        return sampling_kernels.sample(logits, params.temperature, generator)
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    scaled = logits / params.temperature
    logprobs = torch.log_softmax(scaled, -1)
    masked = scaled
    if params.top_k:
        kth = torch.topk(masked, min(params.top_k, masked.shape[-1]), dim=-1).values[:, -1:]
        masked = masked.masked_fill(masked < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(masked, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # Drop a token once the mass before it reaches top_p (the first always stays).
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        masked = torch.full_like(masked, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(masked, -1)
    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
