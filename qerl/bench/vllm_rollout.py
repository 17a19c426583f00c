"""vLLM's rows of ``qerl bench rollout`` (``--weights vllm-bf16,vllm-nvfp4``): the engine
rows' prompts, lengths and sampling on vLLM (``pip install 'qerl[vllm]'``), in the same run,
so that each of our ratios has its anchor beside it.

vllm-nvfp4 serves what ``qerl train`` hands vLLM (``export_for_vllm`` of a ``qerl`` policy:
the NVFP4 compressed-tensors checkpoint, on vLLM's own NVFP4 kernel); vllm-bf16 the BF16
shape with vLLM's dummy weights (speed does not depend on the values, and a 32B BF16
checkpoint would fill a 64 GB disk). LoRA rank 0 serves no adapter (what LoRA costs vLLM);
another rank a PEFT adapter of that rank, unmerged, as during RL.

The KV cache (``--kv-cache``) is vLLM's own option for each of our formats
(``VLLM_KV_CACHE``): bf16 is ``kv_cache_dtype="auto"`` (the model's dtype), fp8 its
documented ``kv_cache_dtype="fp8"`` (E4M3 on NVIDIA cards), the engine otherwise as in the
bf16 rows. Neither export carries KV scales and ``calculate_kv_scales`` stays off, so vLLM's
fp8 cache runs uncalibrated, every scale 1.0: what vLLM does without a calibration (the
llm-compressor one it recommends for accuracy would be stale after every RL step). A scale
is a value, not a shape: it changes no kernel and no byte read, so not the speed.

Each configuration runs in a process of its own, which gives the GPU back whole when it
ends (vLLM keeps memory of an ended engine in the process that made it). peak_gb is left
empty: vLLM sizes its KV cache to a share of the card (``--vllm-memory``), not to the batch.
"""

from __future__ import annotations

import gc
import multiprocessing
import queue
import shutil
from pathlib import Path

import torch

from qerl.bench.throughput import call_prompts, throughput_row, timed
from qerl.config import LoraSettings
from qerl.errors import QerlError
from qerl.export import export_for_vllm
from qerl.formats.kv_cache import DEFAULT as DEFAULT_KV_CACHE
from qerl.policy import build_policy

KINDS = {"vllm-bf16": "lora", "vllm-nvfp4": "qerl"}  # served weights -> policy exported
# Our KV cache formats (qerl.formats.kv_cache.KV_CACHES) -> vLLM's kv_cache_dtype.
VLLM_KV_CACHE = {"bf16": "auto", "fp8": "fp8"}
WARM_UP_TOKENS = 16


class VLLMBenchError(QerlError):
    """vLLM is missing or its run failed."""


def export(arch: str, kind: str, rank: int, out: Path, device: str) -> Path:
    """``out/base`` and ``out/adapter`` (rank ``rank``) of a random-weight ``arch``."""
    policy = build_policy(KINDS[kind], arch=arch, device=device,
                          lora=LoraSettings(rank=rank, alpha=rank))
    try:
        return export_for_vllm(policy, out, overwrite=True,
                               base_weights=kind == "vllm-nvfp4")
    finally:
        del policy
        gc.collect()
        torch.cuda.empty_cache()


def measure(base: Path, adapter: Path | None, rank: int, kind: str, batches: list[int],
            prompt_lens: list[int], gen_len: int, vocab: int, memory: float,
            group: int = 1, kv_cache: str = DEFAULT_KV_CACHE) -> list[dict]:
    """Rows of tokens/s for each prompt length and batch, one vLLM engine for them all
    (``adapter``, of rank ``rank``, None: none), its KV cache in our format ``kv_cache``."""
    import vllm

    llm = vllm.LLM(model=str(base), load_format="dummy" if kind == "vllm-bf16" else "auto",
                   skip_tokenizer_init=True, enable_lora=adapter is not None,
                   max_lora_rank=max(rank, 8), max_loras=1, max_num_seqs=max(batches),
                   max_model_len=max(prompt_lens) + gen_len, gpu_memory_utilization=memory,
                   kv_cache_dtype=VLLM_KV_CACHE[kv_cache], seed=0)
    request = None
    if adapter is not None:
        from vllm.lora.request import LoRARequest

        request = LoRARequest("bench", 1, str(adapter))
    rows = []
    for prompt_len in prompt_lens:
        for batch in batches:
            prompts = {call: [{"prompt_token_ids": p} for p in ids] for call, ids in
                       call_prompts(batch, prompt_len, vocab, group).items()}

            def run(call: str, tokens: int, prompts=prompts):
                sampling = vllm.SamplingParams(n=1, temperature=1.0, max_tokens=tokens,
                                               min_tokens=tokens, ignore_eos=True,
                                               detokenize=False, seed=0)
                outputs = llm.generate(prompts[call], sampling, lora_request=request,
                                       use_tqdm=False)
                made = [len(o.outputs[0].token_ids) for o in outputs]
                if made != [tokens] * len(prompts[call]):
                    raise VLLMBenchError(f"vLLM generated {sorted(set(made))} tokens a "
                                         f"sequence, not {tokens}: its rate would be wrong")

            # vLLM compiled and captured its decode graphs (every batch size up to
            # max_num_seqs) when it started: a short call warms this batch's prefill and
            # the adapter, where a full one would double the run's time for nothing.
            run("warm-up", min(WARM_UP_TOKENS, gen_len))
            first = timed(lambda: run("first token", 1))
            seconds = timed(lambda: run("timed", gen_len))
            rows.append({"lora_rank": rank, "kv_cache": kv_cache, **throughput_row(
                f"vllm {kv_cache} cache ", batch, prompt_len, gen_len, seconds, first,
                peak=False)})
    return rows


def _child(results, *args) -> None:
    try:
        results.put(("rows", measure(*args)))
    except BaseException as e:  # reported to the parent, which raises
        results.put(("error", f"{type(e).__name__}: {e}"))


def bench_vllm(arch: str, kind: str, ranks: list[int], batches: list[int],
               prompt_lens: list[int], gen_len: int, workdir: Path, memory: float = 0.85,
               device: str = "cuda", isolate: bool = True, group: int = 1,
               caches: tuple[str, ...] = (DEFAULT_KV_CACHE,)) -> list[dict]:
    """vLLM's rows for one architecture and weights kind, each LoRA rank in ``ranks`` (0: no
    adapter) and KV cache format in ``caches`` served by an engine of its own (in a process
    of its own unless ``isolate`` is off), its exports under ``workdir`` removed after."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise VLLMBenchError("--weights vllm-*: needs vllm (pip install 'qerl[vllm]'; "
                             "requirements/vllm-cu12.txt and -cu13.txt name the vLLM of "
                             "each torch)") from e
    from qerl.archs import config_for

    vocab = config_for(arch).vocab_size
    rows = []
    adapters = sorted({r for r in ranks if r > 0}) or [8]  # rank 0 alone: any export's base
    out = {rank: Path(workdir) / f"{arch}-{kind}-r{rank}" for rank in adapters}
    try:
        for rank in ranks:
            where = out[rank or adapters[0]]
            if not (where / "base").is_dir():
                export(arch, kind, rank or adapters[0], where, device)
            for kv_cache in caches:
                args = (where / "base", where / "adapter" if rank else None, rank, kind,
                        batches, prompt_lens, gen_len, vocab, memory, group, kv_cache)
                rows += _isolated(args) if isolate else measure(*args)
    finally:
        for where in out.values():
            shutil.rmtree(where, ignore_errors=True)
    return rows


def _isolated(args: tuple) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_child, args=(results, *args))
    process.start()
    while True:
        try:
            what, value = results.get(timeout=5)
            break
        except queue.Empty:
            if not process.is_alive():  # killed (out of memory, a crash): nothing comes
                raise VLLMBenchError(f"vLLM's process ended (exit code {process.exitcode}) "
                                     "without its results") from None
    process.join()
    if what == "error":
        raise VLLMBenchError(f"vLLM's run failed: {value}")
    return value
