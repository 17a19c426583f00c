"""Exports of a trained policy:

- ``export_merged``: one BF16 Hugging Face model with the adapter merged in (the 4-bit base
  dequantized first), for lm-eval, lighteval or any transformers user;
- ``export_for_vllm``: the adapter (PEFT files, LoRA only) beside its base (an NVFP4
  compressed-tensors checkpoint for ``qerl``, a BF16 model for ``lora``), as vLLM serves
  them. Trained norms, which vLLM's LoRA cannot carry, are folded into the base.

Both write into a directory that appears only once complete (``qerl.atomic``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from qerl.atomic import atomic_directory
from qerl.formats import nvfp4
from qerl.formats.nvfp4_checkpoint import PACKED_SUFFIXES, ShardWriter, add_quantization_config
from qerl.nn import NVFP4Linear
from qerl.policy import ADAPTER, Policy, PolicyError

MARKER = "qerl_export.json"


def base_tensors(policy: Policy, merge_lora: bool, keep_nvfp4: bool = False
                 ) -> dict[str, torch.Tensor | nvfp4.NVFP4Tensor]:
    """The base model's tensors by state-dict name: 4-bit weights dequantized to BF16 (or
    kept as NVFP4Tensor with ``keep_nvfp4``), LoRA merged in fp32 if ``merge_lora``."""
    out: dict[str, torch.Tensor | nvfp4.NVFP4Tensor] = {}
    _collect(policy.base_model, "", merge_lora, keep_nvfp4, out)
    if getattr(policy.config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)  # stored once, as the embedding
    return out


def _collect(module: nn.Module, prefix: str, merge: bool, keep_nvfp4: bool, out: dict) -> None:
    if isinstance(module, LoraLayer):
        _collect(module.get_base_layer(), prefix, False, keep_nvfp4 and not merge, out)
        if merge:
            weight = out[f"{prefix}weight"].float()
            for adapter in module.active_adapters:
                weight = weight + module.get_delta_weight(adapter).float()
            out[f"{prefix}weight"] = weight.to(torch.bfloat16)
        return
    if isinstance(module, NVFP4Linear):
        q = module.packed_weight
        if keep_nvfp4:
            for suffix, t in zip(PACKED_SUFFIXES, (q.packed, q.scale, q.global_scale),
                                 strict=True):
                out[f"{prefix}{suffix}"] = t
        else:
            out[f"{prefix}weight"] = nvfp4.dequantize(q, torch.bfloat16)
        if module.bias is not None:
            out[f"{prefix}bias"] = module.bias.detach()
        return
    if type(module).__name__ == "Linear4bit":  # bitsandbytes NF4 (QLoRA's base)
        import bitsandbytes.functional as bnbf

        w = module.weight
        out[f"{prefix}weight"] = bnbf.dequantize_4bit(w.data, w.quant_state).to(torch.bfloat16)
        if module.bias is not None:
            out[f"{prefix}bias"] = module.bias.detach()
        return
    for name, p in module.named_parameters(recurse=False):
        out[f"{prefix}{name}"] = p.detach()
    for name, b in module.named_buffers(recurse=False):
        if name not in module._non_persistent_buffers_set:
            out[f"{prefix}{name}"] = b
    for name, child in module.named_children():
        _collect(child, f"{prefix}{name}.", merge, keep_nvfp4, out)


def _write_model(policy: Policy, directory: Path, tensors: dict | None, nvfp4_ignore=None,
                 tokenizer=None) -> None:
    """The model's files; ``tensors`` None writes its configuration alone."""
    if tensors is not None:
        writer = ShardWriter(directory)
        for name, t in tensors.items():
            # fp32 here is a norm kept at full precision for AQN or training: stored as
            # BF16, like the rest; NVFP4's global scale is fp32 by format.
            keep = t.dtype != torch.float32 or name.endswith("weight_global_scale")
            writer.add(name, t if keep else t.to(torch.bfloat16))
        writer.close()
    settings = policy.config.to_dict()
    # The source's own quantization (GGUF, a compressed-tensors checkpoint) is gone from
    # these tensors: a stale entry would make transformers look for the old format.
    settings.pop("quantization_config", None)
    # A GGUF source names no architecture; a loader without one guesses (vLLM took the
    # headless LlamaModel): name the class the model is.
    settings["architectures"] = settings.get("architectures") or [
        type(policy.base_model).__name__]
    config = policy.config.__class__.from_dict(settings)
    config.dtype = torch.bfloat16
    config.save_pretrained(directory)
    if nvfp4_ignore is not None:
        add_quantization_config(directory, ignore=nvfp4_ignore)
    if tokenizer is not None:  # named explicitly: random weights have none of their own
        tokenizer.save_pretrained(directory)
    elif policy.save_extras is not None:
        policy.save_extras(directory)


def _record(directory: Path, policy: Policy, kind: str) -> None:
    (directory / MARKER).write_text(json.dumps(
        {"kind": kind, "method": policy.method, "source": policy.source}, indent=2))


def export_merged(policy: Policy, out: str | Path, overwrite: bool = False,
                  tokenizer=None) -> Path:
    """A BF16 model with the adapter (and trained norms) merged in; ``tokenizer`` replaces
    the source's tokenizer files."""
    with atomic_directory(out, overwrite, MARKER, "qerl export") as tmp:
        _write_model(policy, tmp, base_tensors(policy, merge_lora=policy.lora is not None),
                     tokenizer=tokenizer)
        _record(tmp, policy, "merged")
    return Path(out)


def export_for_vllm(policy: Policy, out: str | Path, overwrite: bool = False,
                    tokenizer=None, base_weights: bool = True) -> Path:
    """``out/adapter`` (PEFT LoRA files) and ``out/base`` (NVFP4 checkpoint for ``qerl``,
    BF16 for ``lora``). ``base_weights=False``: the BF16 base's configuration alone, for
    vLLM's ``load_format="dummy"`` (benchmarks: a 32B BF16 base is 64 GB of disk)."""
    if policy.method not in ("qerl", "lora"):
        raise PolicyError(f"vLLM serves the qerl and lora exports; for {policy.method!r} "
                          "export a merged model")
    if not base_weights and policy.method != "lora":
        raise PolicyError("only a BF16 base (lora) can go without its weights: vLLM's dummy "
                          "weights are not NVFP4 codes")
    with atomic_directory(out, overwrite, MARKER, "qerl export") as tmp:
        tensors = (base_tensors(policy, merge_lora=False, keep_nvfp4=policy.method == "qerl")
                   if base_weights else None)
        (tmp / "base").mkdir()
        ignore = None
        if policy.method == "qerl":
            dense_linears = [n.removesuffix(".weight") for n, t in tensors.items()
                             if n.endswith("proj.weight")]
            ignore = ["lm_head", *dense_linears]
        _write_model(policy, tmp / "base", tensors, nvfp4_ignore=ignore, tokenizer=tokenizer)
        policy.model.save_pretrained(tmp / "adapter", selected_adapters=[ADAPTER])
        _record(tmp, policy, "vllm")
    return Path(out)
