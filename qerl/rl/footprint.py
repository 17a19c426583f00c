"""Where one RL step's GPU memory goes, from the model's shape alone (no GPU): the terms a
memory budget (qerl.rl.budget) fits a step into, and `qerl bench footprint` tabulates.

A step: the rollout engine holds ``sequences`` sequences of ``prompt_len + completion``
tokens in its KV cache (it keeps the cache between rollouts, so the cache is there during
training too); then the forward and backward run in micro-batches of ``micro_batch``
sequences with gradient checkpointing (without it every layer keeps its activations,
which this does not model). The terms, decimal GB:

- weights: the decoder's projections in the method's format (BF16 2 bytes a weight; NVFP4
  and NF4 4 bits plus one 8- or 32-bit scale per 16 or 64: 0.5625 bytes), the rest (input
  embedding, lm_head) in BF16; with ``embedding_on_host`` the input embedding is in the
  host's memory instead (qerl.nn.host_embedding; an untied one only: a tied table is the
  lm_head's);
- lora: the adapters in fp32 with their gradients and the optimizer's two moments: 16
  bytes a parameter with AdamW in fp32; with bitsandbytes' 8-bit AdamW 10 (its per-block
  scales left out); with ``optimizer_on_host`` 8 (the moments are in the host's memory,
  qerl.rl.host_optimizer);
- kv_cache: keys and values of every layer for each token of each sequence, in BF16, or
  with ``kv_cache`` fp8 in one byte each plus two fp32 scales per (layer, kv head) a
  sequence (engine.kv_cache, qerl/formats/kv_cache.py);
- checkpointed: each layer's input for one micro-batch, kept for the backward pass; with
  ``activations_on_host`` (offload.activations) they wait in the host's memory and the
  GPU holds the one brought back for its layer's recompute;
- layer: one layer's activations while it is recomputed in the backward pass: for lora and
  qerl 4 intermediate-sized and 8 hidden-sized BF16 tensors a token (fitted to the measured
  7B, 14B and 32B steps: LoRA added inside the GEMM, Liger's norm and SwiGLU); qlora's
  LoRA layer is PEFT's own, which keeps an fp32 copy of each projection's input for the
  adapter (six hidden-sized, one intermediate-sized: 12 and 2 BF16 tensors' worth more),
  so 6 and 20; and for a 4-bit base (qerl, qlora) the largest projection decoded to BF16,
  which its GEMM over so many rows reads (the allocation a capped 7B step ran out of
  memory on: its error in results/bench/budget_*.csv);
- logprob: the log-probabilities of the completion tokens, by TRL's fused LM head
  (``trl.trainer.utils.add_fused_lm_head``), which never holds [tokens x vocab]: a tile of
  TOKEN_TILE x VOCAB_TILE BF16 logits at a time, the completions' hidden states (BF16)
  kept for its backward and their gradient in fp32 (from TRL's code, not fitted). It runs
  before the layers' backward, not beside it, so the step's activations peak at the larger
  of ``layer`` and ``logprob`` (``layer`` at every Qwen2.5 shape).

``total`` is weights + lora + kv_cache + checkpointed + the larger of layer and logprob:
torch's allocated peak; with ``cache_released`` (the engine frees its cache after each
step's rollouts, engine.release_cache) the cache and the training's activations are not
held at once, and the total is weights + lora + the larger of the two. The total without
the measures is the peak tests/test_bench_cli.py holds within 10% of every committed `qerl
bench step` measurement. What the driver counts beyond it (the CUDA context, kernel
modules, the allocator's unused reserve) is the budget's allowance, not a term here.
"""

from __future__ import annotations

from dataclasses import dataclass

from qerl.formats.kv_cache import DEFAULT, KV_CACHES, SCALE_BYTES
from qerl.methods import LORA_METHODS

GB = 1e9
BF16 = 2
FP8 = 1
QUANTIZED_BYTES = 0.5 + 1 / 16  # 4-bit values + one 8-bit scale per 16 (NF4: 32-bit per 64)
# An adapter parameter (fp32) and its gradient (fp32), and the optimizer's two moments.
ADAPTER_BYTES = {"adamw_torch": 4 + 4 + 2 * 4, "adamw_8bit": 4 + 4 + 2 * 1}
# The same with the moments in the host's memory (qerl.rl.host_optimizer, AdamW in fp32).
HOST_OPTIMIZER_BYTES = 4 + 4
# TRL's fused LM head's tile (trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE, tokens, and
# trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE, vocabulary entries; a test keeps them equal).
TOKEN_TILE = 4096
VOCAB_TILE = 32768


@dataclass(frozen=True)
class Step:
    """What one RL step holds at once: ``sequences`` in the rollout's KV cache,
    ``micro_batch`` sequences a forward and backward, each of ``prompt_len + completion``
    tokens; LoRA of ``rank`` trained by ``optimizer``; the KV cache's format ``kv_cache``
    (engine.kv_cache). Memory measures: the input embedding, the optimizer's moments and
    the checkpointed layer inputs in the host's memory, the KV cache freed while training."""

    method: str
    sequences: int
    micro_batch: int
    prompt_len: int
    completion: int
    rank: int = 32
    optimizer: str = "adamw_torch"
    embedding_on_host: bool = False
    optimizer_on_host: bool = False
    cache_released: bool = False
    activations_on_host: bool = False
    kv_cache: str = DEFAULT

    def __post_init__(self) -> None:
        if self.method not in LORA_METHODS:
            raise ValueError(f"the footprint models the LoRA methods {LORA_METHODS}, not "
                             f"{self.method!r}")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"the footprint models the KV caches {KV_CACHES}, not "
                             f"{self.kv_cache!r}")
        if self.optimizer not in ADAPTER_BYTES:
            raise ValueError(f"the footprint models the optimizers {tuple(ADAPTER_BYTES)}, "
                             f"not {self.optimizer!r}")
        if self.optimizer_on_host and self.optimizer != "adamw_torch":
            raise ValueError(f"the optimizer in host memory is AdamW in fp32 (adamw_torch), "
                             f"not {self.optimizer!r}")
        for name in ("sequences", "micro_batch", "prompt_len", "completion", "rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def tokens(self) -> int:
        return self.prompt_len + self.completion


def projection_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of each projection of one decoder layer: q, k, v, o, gate, up, down."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden),
            (hidden, inter), (hidden, inter), (inter, hidden)]


def step_memory(config, step: Step) -> dict[str, float]:
    """The terms of ``step``'s peak GPU memory (GB) for a model of ``config`` (a transformers
    config: its sizes), and their ``total``."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    shapes = projection_shapes(config)
    kv_width = shapes[1][1]
    # a token's keys (or values) in a layer, and a sequence's scales of them (fp8)
    kv_token, kv_scales = ((kv_width * FP8, config.num_key_value_heads * SCALE_BYTES)
                           if step.kv_cache == "fp8" else (kv_width * BF16, 0))
    projections = layers * sum(a * b for a, b in shapes)
    adapters = layers * sum(step.rank * (a + b) for a, b in shapes)
    if step.embedding_on_host and config.tie_word_embeddings:
        raise ValueError("a tied input embedding is the lm_head's table: it stays on the GPU")
    tables = 1 if config.tie_word_embeddings or step.embedding_on_host else 2
    dense = config.vocab_size * hidden * tables
    scored = step.micro_batch * step.completion  # completion tokens a micro-batch scores
    per_token = (6 * inter + 20 * hidden) if step.method == "qlora" else (4 * inter + 8 * hidden)
    # A 4-bit projection over a training micro-batch's thousands of rows is decoded to BF16
    # whole, then one GEMM (kernels/nvfp4_matmul.py's dequant path, the only one beyond 32
    # rows on a card without the Hopper GEMM; bitsandbytes' NF4 matmul alike), forward and
    # input gradient: one projection's BF16 copy at a time, the largest the peak.
    decoded = 0 if step.method == "lora" else max(a * b for a, b in shapes) * BF16
    terms = {
        "weights": projections * (BF16 if step.method == "lora" else QUANTIZED_BYTES)
        + dense * BF16,
        "lora": adapters * (HOST_OPTIMIZER_BYTES if step.optimizer_on_host
                            else ADAPTER_BYTES[step.optimizer]),
        "kv_cache": layers * 2 * (kv_token * step.tokens + kv_scales) * step.sequences,
        "checkpointed": (1 if step.activations_on_host else layers) * step.micro_batch
        * step.tokens * hidden * BF16,
        "layer": step.micro_batch * step.tokens * per_token * BF16 + decoded,
        "logprob": min(scored, TOKEN_TILE) * min(config.vocab_size, VOCAB_TILE) * BF16
        + scored * hidden * (BF16 + 4),
    }
    terms = {k: v / GB for k, v in terms.items()}
    training = terms["checkpointed"] + max(terms["layer"], terms["logprob"])
    held = (max(terms["kv_cache"], training) if step.cache_released
            else terms["kv_cache"] + training)
    return {**terms, "total": terms["weights"] + terms["lora"] + held}
