"""The embedded rollout engine: batched prefill + decode on the live policy, with a static
KV cache sized from a memory budget and the decode step replayed from a CUDA graph.

    engine = Engine(policy, max_batch=32, max_seq_len=1280)
    out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=1024, temperature=1.0))
    out.tokens, out.logprobs, out.finish_reasons

Every call reads the policy's current parameters (LoRA, AQN-noised norms, NVFP4 codes) in
place: there is no weight sync. A CUDA graph, captured once per batch size and 256-slot
bucket of context, holds pointers to those same tensors, so in-place optimizer updates are
seen by the next replay; after replacing modules or tensors instead (``load_adapter``,
``model.to(...)``) call ``engine.reset()`` so that the graphs are captured again. A batch
shrinks to its live sequences once most have stopped (COMPACT_WHEN). A prompt given several
times (GRPO samples each of a step's prompts G times) is prefilled once, and its rows of
the cache copied to its repeats. ``kv_cache="fp8"`` keeps keys and values in 8 bits with a
scale per (layer, sequence, kv head) (qerl/formats/kv_cache.py): half the bytes a slot.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from qerl.archs import MODEL_TYPES
from qerl.errors import QerlError
from qerl.formats import kv_cache as kv_formats
from qerl.rollout.decoder import Decoder, KVCache
from qerl.rollout.sampling_params import SamplingParams, sample

# A step attends over the cache's slots up to its own, rounded up to a multiple of this: one
# CUDA graph per batch size and bucket, instead of reading the whole cache at every step
# (at 2048 new tokens, twice the keys and values that the live slots hold on average).
SLOT_BUCKET = 256
# Steps between checks whether every sequence has stopped: a check waits for the GPU, and
# between checks the host queues steps ahead of it (its launch time hidden) at the price
# of up to this many - 1 wasted steps once all have stopped.
STOP_CHECK_EVERY = 8
# A batch keeps decoding until its last sequence stops, and a stopped sequence costs a step
# as much as a live one (its keys and values are read all the same). Once no more than
# 1/COMPACT_WHEN of the rows are live, the live ones move to the front of the cache and the
# batch continues as the next power of two that holds them: a 135M model evaluated 384 at a
# time mostly decodes for one looping sequence. Batches under COMPACT_FROM rows stay whole
# (a smaller step saves little there, and every size is one more captured graph).
COMPACT_WHEN = 4
COMPACT_FROM = 32
# The prefill runs whole sequences, at most this many tokens a forward. Its activations grow
# with batch x prompt (PEFT's fp32 LoRA outputs at these rows: a 7B rollout's peak grew by
# tens of GB from 1 to 512 prompts of 256 tokens in one forward); the cache's do not. At
# this many rows the projections' GEMMs already run at full rate.
PREFILL_TOKENS = 16384


class RolloutError(QerlError):
    """A rollout request the engine cannot serve."""


class CacheMemoryError(RolloutError):
    """The KV cache asked for does not fit in the device's free memory."""


def free_bytes(device: torch.device) -> int | None:
    """Memory a new tensor on ``device`` can take: the driver's free memory plus what torch's
    allocator holds unused; None off CUDA (the host's memory is not checked)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def cache_dtype(kv_cache: str, dtype: torch.dtype) -> torch.dtype:
    """What a KV cache of format ``kv_cache`` (engine.kv_cache) stores for a model that
    computes in ``dtype``."""
    if kv_cache not in kv_formats.KV_CACHES:
        raise RolloutError(f"engine.kv_cache is one of {', '.join(kv_formats.KV_CACHES)}, not "
                           f"{kv_cache!r}")
    if kv_cache == "bf16":  # the model's own
        return dtype
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        raise RolloutError(f"engine.kv_cache fp8 stores torch.float8_e4m3fn, which torch "
                           f"{torch.__version__} does not have: use engine.kv_cache bf16")
    return fp8


@dataclass
class Rollout:
    """Per sequence: the generated tokens (a stop token included), each one's sampling
    log-probability, and why it ended ("stop" or "length")."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]


def _base_model(model) -> nn.Module:
    """The transformers CausalLM of a qerl Policy, a PeftModel or the model itself."""
    from peft import PeftModel

    from qerl.policy import Policy

    if isinstance(model, Policy):
        return model.base_model
    return model.get_base_model() if isinstance(model, PeftModel) else model


class Engine:
    """Serves up to ``max_batch`` sequences of up to ``max_seq_len`` tokens (prompt plus
    generation). ``kv_budget_bytes``, if given, caps the cache; ``Engine.max_batch_for``
    says how many sequences a budget holds. ``fused`` (default: on CUDA) runs the step's
    norms, rotary and LoRA as our kernels (see ``Decoder``). A step attends over the cache
    up to its slot rounded up to ``slot_bucket`` (see SLOT_BUCKET). ``compact`` lets a
    batch shrink to its live sequences as they stop (see COMPACT_WHEN). The prefill takes
    whole sequences, at most ``prefill_tokens`` tokens a forward (see PREFILL_TOKENS);
    ``share_prompts`` prefills a repeated prompt once for all its repeats. ``kv_cache``
    (qerl.formats.kv_cache.KV_CACHES) is the cache's format: the model's dtype, or fp8."""

    def __init__(self, model, max_batch: int, max_seq_len: int,
                 kv_budget_bytes: int | None = None, cuda_graphs: bool = True,
                 fused: bool | None = None, slot_bucket: int = SLOT_BUCKET,
                 compact: bool = True, prefill_tokens: int = PREFILL_TOKENS,
                 share_prompts: bool = True, kv_cache: str = kv_formats.DEFAULT):
        self.model = _base_model(model)
        config = self.model.config
        if config.model_type not in MODEL_TYPES:
            raise RolloutError(f"the engine runs {', '.join(MODEL_TYPES)} models, not "
                               f"{config.model_type!r}")
        if max_batch < 1 or max_seq_len < 2 or slot_bucket < 1 or prefill_tokens < 1:
            raise RolloutError(f"need max_batch >= 1, max_seq_len >= 2, slot_bucket >= 1 and "
                               f"prefill_tokens >= 1, got {max_batch}, {max_seq_len}, "
                               f"{slot_bucket}, {prefill_tokens}")
        self.dtype = self.model.get_input_embeddings().weight.dtype
        # The lm_head's: the input embedding's table may be in the host's memory
        # (qerl.nn.host_embedding), the lm_head's is always where the model computes.
        self.device = self.model.get_output_embeddings().weight.device
        self.kv_cache, self.cache_dtype = kv_cache, cache_dtype(kv_cache, self.dtype)
        need = max_batch * KVCache.bytes_per_sequence(config, max_seq_len, self.cache_dtype)
        if kv_budget_bytes is not None and need > kv_budget_bytes:
            fits = self.max_batch_for(config, kv_budget_bytes, max_seq_len, self.dtype,
                                      kv_cache)
            raise RolloutError(f"a KV cache for {max_batch} x {max_seq_len} tokens needs "
                               f"{need / 1e9:.2f} GB, over the budget of "
                               f"{kv_budget_bytes / 1e9:.2f} GB (it holds {fits} sequences)")
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.slot_bucket, self.prefill_tokens = slot_bucket, prefill_tokens
        self.decoder = Decoder(self.model, fused=self.device.type == "cuda" if fused is None
                               else fused)
        self.cache: KVCache | None = None
        self._allocate()
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.compact, self.share_prompts = compact, share_prompts
        self._graphs: dict[tuple[int, int], tuple] = {}

    @classmethod
    def for_budget(cls, model, kv_budget_bytes: int, max_seq_len: int, **kwargs) -> Engine:
        """An engine with as many sequences of ``max_seq_len`` as the KV budget holds."""
        base = _base_model(model)
        dtype = base.get_input_embeddings().weight.dtype
        batch = cls.max_batch_for(base.config, kv_budget_bytes, max_seq_len, dtype,
                                  kwargs.get("kv_cache", kv_formats.DEFAULT))
        if batch < 1:
            raise RolloutError(f"a KV budget of {kv_budget_bytes / 1e9:.3f} GB holds no "
                               f"sequence of {max_seq_len} tokens")
        return cls(model, batch, max_seq_len, kv_budget_bytes=kv_budget_bytes, **kwargs)

    def reset(self) -> None:
        """Forget the captured CUDA graphs (after the model's tensors were replaced)."""
        self._graphs.clear()

    def release(self) -> None:
        """Free the KV cache and the captured graphs (whose pools hold their own memory),
        so that what comes next (training) has their memory; the next ``generate`` makes
        them again, a graph capture per batch size and slot bucket it decodes."""
        self.cache = None
        self.reset()

    def _allocate(self) -> None:
        config = self.model.config
        need = self.max_batch * KVCache.bytes_per_sequence(config, self.max_seq_len,
                                                           self.cache_dtype)
        free = free_bytes(self.device)
        if free is not None and need > free:
            # Said here, before the allocation: torch's out-of-memory error would name
            # neither the cache nor how to make it fit.
            fits = self.max_batch_for(config, free, self.max_seq_len, self.dtype,
                                      self.kv_cache)
            raise CacheMemoryError(
                f"a KV cache for {self.max_batch} sequences of {self.max_seq_len} tokens "
                f"needs {need / 1e9:.2f} GB, and {self.device} has {free / 1e9:.2f} GB free "
                f"(it holds {fits}): roll out fewer sequences at once (qerl train: "
                f"engine.kv_budget_gb samples a step's batch in chunks) or shorter ones")
        self.cache = KVCache.allocate(config, self.max_batch, self.max_seq_len,
                                      self.cache_dtype, self.device)

    @staticmethod
    def max_batch_for(config, kv_budget_bytes: int, max_seq_len: int,
                      dtype: torch.dtype = torch.bfloat16,
                      kv_cache: str = kv_formats.DEFAULT) -> int:
        """The sequences of ``max_seq_len`` tokens a cache of format ``kv_cache`` holds in
        ``kv_budget_bytes``, for a model that computes in ``dtype``."""
        return kv_budget_bytes // KVCache.bytes_per_sequence(config, max_seq_len,
                                                             cache_dtype(kv_cache, dtype))

    def _check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if not prompts:
            raise RolloutError("no prompts to roll out")
        if len(prompts) > self.max_batch:
            raise RolloutError(f"a batch of {len(prompts)} prompts exceeds the engine's "
                               f"max_batch of {self.max_batch}")
        vocab = self.model.config.vocab_size
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise RolloutError(f"prompt {i} is empty")
            if len(prompt) + params.max_new_tokens > self.max_seq_len:
                raise RolloutError(
                    f"prompt {i} has {len(prompt)} tokens; with max_new_tokens "
                    f"{params.max_new_tokens} it exceeds the cache's max_seq_len "
                    f"{self.max_seq_len}")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise RolloutError(f"prompt {i} has token ids outside [0, {vocab})")

    def _view(self, batch: int, slots: int | None = None, first: int = 0) -> KVCache:
        """The cache of ``batch`` sequences from the ``first``-th, its first ``slots`` slots
        (all)."""
        return self.cache.rows(slice(first, first + batch), slots or self.max_seq_len)

    def _prefill(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """The prompts (left-padded, [B, T]) into the cache -> logits of their last position
        [B, V], at most ``prefill_tokens`` tokens a forward (whole sequences)."""
        batch, longest = ids.shape
        span = self._span(longest - 1)
        self._view(batch, span).pad.copy_(pad)
        ids, start = ids.to(self.device), torch.zeros((), dtype=torch.long, device=self.device)
        rows = max(1, self.prefill_tokens // longest)
        logits = [self.decoder(ids[first:first + rows], start,
                               self._view(min(rows, batch - first), span, first), prefill=True)
                  for first in range(0, batch, rows)]
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _span(self, last_slot: int) -> int:
        """The slots a step that writes up to ``last_slot`` attends over."""
        bucket = self.slot_bucket
        return min(self.max_seq_len, -(-(last_slot + 1) // bucket) * bucket)

    @contextmanager
    def _eval(self):
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def _decode(self, ids: torch.Tensor, slot: int, at: torch.Tensor) -> torch.Tensor:
        """One decode step (ids [B, 1] at cache slot ``slot``, also given on the device as
        ``at``, so that no step waits for a host-to-device copy) -> logits [B, V]: eager, or
        a CUDA graph replay, captured on the first step of each batch size and slot bucket.
        Warm-up and capture run on this step's own inputs, so the slot they write holds
        the right keys and values whatever happens next."""
        batch, span = ids.shape[0], self._span(slot)
        cache = self._view(batch, span)
        if not self.cuda_graphs:
            return self.decoder(ids, at, cache)
        if (batch, span) not in self._graphs:
            ids, at = ids.clone(), at.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up: autotuning, workspaces
                for _ in range(2):
                    self.decoder(ids, at, cache)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self.decoder(ids, at, cache)
            self._graphs[batch, span] = (graph, ids, at, logits)
        graph, ids_buf, slot_buf, logits = self._graphs[batch, span]
        ids_buf.copy_(ids)
        slot_buf.copy_(at)
        graph.replay()
        return logits

    def _compacted(self, live: torch.Tensor, slots: int) -> torch.Tensor | None:
        """When few of the batch's rows are ``live``, the rows to go on with: the live ones,
        then stopped ones up to the next power of two, moved to the front of the cache (its
        first ``slots`` slots, which hold every token so far, and the padding); None while
        the batch stays whole."""
        batch = live.numel()
        if not self.compact or batch < COMPACT_FROM:
            return None  # before the count: no second wait for the GPU at every check
        count = int(live.sum())
        if count * COMPACT_WHEN > batch:
            return None
        size = 1 << max(count - 1, 0).bit_length()
        pick = torch.argsort((~live).to(torch.int8), stable=True)[:size]
        self._move_rows(pick, slots)
        return pick

    def _move_rows(self, rows: torch.Tensor, slots: int) -> None:
        """The cache's first len(rows) rows become its rows ``rows`` (their first ``slots``
        slots, their padding and an fp8 cache's scales), in that order; a row may be taken
        more than once."""
        # fp8 moved as its bytes, which torch indexes on every device
        kv = [t.view(torch.uint8) if self.cache.scales else t
              for t in (self.cache.k, self.cache.v)]
        for layer in range(self.cache.k.shape[0]):  # a layer at a time: little scratch
            for part in kv:
                part[layer, :rows.numel(), :, :slots] = part[layer, rows, :, :slots]
        for part in (self.cache.pad, *(s.transpose(0, 1) for s in self.cache.scales)):
            part[:rows.numel()] = part[rows]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        self._check(prompts, params)
        if self.cache is None:
            self._allocate()
        batch, longest = len(prompts), max(len(p) for p in prompts)
        # Each distinct prompt numbered by its first row, and the one each row repeats
        # (prefilled once each with share_prompts, else every row is).
        firsts: dict[tuple[int, ...], int] = {}
        repeats = [firsts.setdefault(tuple(p), len(firsts)) for p in prompts]
        distinct = list(firsts) if self.share_prompts else prompts
        ids = torch.zeros((len(distinct), longest), dtype=torch.long)
        pad = torch.tensor([longest - len(p) for p in distinct])
        for b, prompt in enumerate(distinct):
            ids[b, pad[b]:] = torch.tensor(prompt)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        stops = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long,
                             device=self.device)
        with self._eval():
            logits = self._prefill(ids, pad)
            if len(distinct) < batch:
                rows = torch.tensor(repeats, device=self.device)
                self._move_rows(rows, longest)
                logits = logits[rows]
            # Per sequence of the call, written at each compaction and at the end; `order`
            # maps the batch's rows (and `done`, `length`, the steps since `first`) to them.
            out_tokens = torch.zeros((batch, params.max_new_tokens), dtype=torch.long,
                                     device=self.device)
            out_logprobs = torch.zeros((batch, params.max_new_tokens), device=self.device)
            out_done = torch.zeros(batch, dtype=torch.bool, device=self.device)
            out_length = torch.full((batch,), params.max_new_tokens, device=self.device)
            order = torch.arange(batch, device=self.device)
            first, tokens, logprobs = 0, [], []
            done, length = out_done.clone(), out_length.clone()

            def flush():
                if tokens:
                    steps = slice(first, first + len(tokens))
                    out_tokens[order, steps] = torch.stack(tokens, 1)
                    out_logprobs[order, steps] = torch.stack(logprobs, 1).float()
                out_done[order], out_length[order] = done, length

            slots = torch.arange(longest, longest + params.max_new_tokens, device=self.device)
            for t in range(params.max_new_tokens):
                token, logprob = sample(logits, params, generator, fused=self.decoder.fused)
                tokens.append(token)
                logprobs.append(logprob)
                if not params.ignore_eos and stops.numel():
                    stopped = torch.isin(token, stops) & ~done
                    length = torch.where(stopped, t + 1, length)
                    done |= stopped
                    if (t + 1) % STOP_CHECK_EVERY == 0:
                        if bool(done.all()):
                            break
                        pick = self._compacted(~done, longest + t)
                        if pick is not None:
                            flush()
                            first, tokens, logprobs = t + 1, [], []
                            order, token = order[pick], token[pick]
                            done, length = done[pick], length[pick]
                if t + 1 < params.max_new_tokens:
                    logits = self._decode(token[:, None], longest + t, slots[t])
            flush()
        out_tokens = out_tokens.tolist()
        out_logprobs = out_logprobs.tolist()
        lengths = out_length.tolist()
        done = out_done.tolist()
        return Rollout([row[:n] for row, n in zip(out_tokens, lengths, strict=True)],
                       [row[:n] for row, n in zip(out_logprobs, lengths, strict=True)],
                       ["stop" if d else "length" for d in done])
