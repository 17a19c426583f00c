"""Quantize a model to an NVFP4 compressed-tensors checkpoint, layer by layer.

Every ``nn.Linear`` of the decoder becomes NVFP4 (lm_head stays BF16, as do embeddings,
norms and biases); q/k/v and gate/up share one global scale because vLLM fuses them.
The output directory appears only once complete: it is written under a temporary name and
renamed at the end, so a failure never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from qerl.atomic import atomic_directory
from qerl.errors import ArchitectureError, CheckpointError, GroupSizeError, QerlError
from qerl.formats import nvfp4
from qerl.formats.nvfp4_checkpoint import PACKED_SUFFIXES, ShardWriter, add_quantization_config
from qerl.sources import Source

# Projections that vLLM fuses into one matrix, so they must share a global scale.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
KEEP_DENSE = ("lm_head",)
REPORT_NAME = "quantization_report.json"


def linear_layers(source: Source) -> list[str]:
    """Module names of the decoder's Linear layers, in model order (lm_head excluded)."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(source.config)
    except (ValueError, KeyError) as e:
        raise ArchitectureError(f"{source.description}: unsupported architecture ({e})") from e
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.split(".")[-1] not in KEEP_DENSE
    ]


def fusion_groups(layers: list[str]) -> list[list[str]]:
    """Split layers into groups sharing a global scale; unfused layers form groups of one."""
    groups: dict[tuple[str, int], list[str]] = {}
    for name in layers:
        parent, _, leaf = name.rpartition(".")
        kind = next((i for i, fused in enumerate(FUSED) if leaf in fused), None)
        key = (parent, kind) if kind is not None else (name, -1)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def quantize_group(weights: dict[str, torch.Tensor], strict: bool = False
                   ) -> tuple[dict[str, nvfp4.NVFP4Tensor], dict[str, str]]:
    """Quantize one fusion group (layer name -> weight) with a shared global scale. A
    weight whose input dim is not a multiple of 16 is left out with its reason (or raises
    if ``strict``); NaN/Inf raises, naming the layer. Returns (quantized, skipped)."""
    keep, skipped = {}, {}
    for layer, w in weights.items():
        try:
            nvfp4.check_weight(w, layer)
        except GroupSizeError as e:
            if strict:
                raise
            skipped[layer] = str(e)
            continue
        keep[layer] = w
    shared = nvfp4.shared_global_scale(*keep.values()) if keep else None
    return {layer: nvfp4.quantize(w, shared, layer) for layer, w in keep.items()}, skipped


@dataclass
class Report:
    """What ``quantization_report.json`` holds: per-layer error, skipped layers, a summary."""

    source: str
    device: str
    layers: dict[str, dict] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    source_params: int = 0
    checkpoint_bytes: int = 0

    def add_layer(self, name: str, weight: torch.Tensor, q: nvfp4.NVFP4Tensor, fused: list[str]):
        ref = weight.to(torch.float32)
        norm = torch.linalg.vector_norm(ref).item()
        err = torch.linalg.vector_norm(nvfp4.dequantize(q, torch.float32) - ref).item()
        self.layers[name] = {
            "shape": list(weight.shape),
            "global_scale": q.global_scale.item(),
            "fused_with": [f for f in fused if f != name],
            "rel_error": err / norm if norm > 0 else 0.0,
        }

    def to_dict(self) -> dict:
        errors = {name: layer["rel_error"] for name, layer in self.layers.items()}
        worst = max(errors, key=errors.get) if errors else None
        summary = {
            "quantized_layers": len(self.layers),
            "skipped_layers": len(self.skipped),
            "mean_rel_error": sum(errors.values()) / len(errors) if errors else None,
            "max_rel_error": errors[worst] if worst else None,
            "max_rel_error_layer": worst,
            "bf16_bytes": 2 * self.source_params,
            "checkpoint_bytes": self.checkpoint_bytes,
            "compression": 2 * self.source_params / max(self.checkpoint_bytes, 1),
            "device": self.device,
        }
        return {
            "source": self.source,
            "summary": summary,
            "skipped": self.skipped,
            "layers": self.layers,
        }


def quantize_model(
    source: Source,
    out: str | Path,
    *,
    overwrite: bool = False,
    strict: bool = False,
    device: str | torch.device = "cpu",
    max_shard_bytes: int = 2 << 30,
    progress: bool = True,
) -> dict:
    """Write ``source`` as an NVFP4 checkpoint to ``out``; return the report as a dict.

    A Linear whose input dim is not a multiple of 16 stays BF16 (listed in the config's
    ``ignore`` and the report), or raises if ``strict``. NaN/Inf in any weight raises.
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise QerlError("--device cuda was asked for, but no CUDA GPU is available")
    with atomic_directory(out, overwrite, REPORT_NAME, "qerl quantize") as tmp:
        report = _write(source, tmp, strict, device, max_shard_bytes, progress)
    return report


def _write(source, tmp: Path, strict, device, max_shard_bytes, progress) -> dict:
    report = Report(source=source.description, device=str(device))
    names = set(source.names())
    layers = linear_layers(source)
    missing = [f"{layer}.weight" for layer in layers if f"{layer}.weight" not in names]
    if missing:
        raise CheckpointError(f"{source.description} lacks tensor(s) {missing[:5]}")
    writer = ShardWriter(tmp, max_shard_bytes)

    for group in tqdm(fusion_groups(layers), desc="quantize", unit="group", disable=not progress):
        loaded = source.load([f"{layer}.weight" for layer in group], device)
        weights = {layer: loaded[f"{layer}.weight"] for layer in group}
        quantized, skipped = quantize_group(weights, strict)
        for layer, reason in skipped.items():
            report.skipped[layer] = reason
            writer.add(f"{layer}.weight", weights[layer].to(torch.bfloat16))
        for layer, q in quantized.items():
            report.add_layer(layer, weights[layer], q, list(quantized))
            parts = (q.packed, q.scale, q.global_scale)
            for suffix, t in zip(PACKED_SUFFIXES, parts, strict=True):
                writer.add(f"{layer}.{suffix}", t)
        report.source_params += sum(w.numel() for w in weights.values())
        del loaded, weights, quantized

    consumed = {f"{layer}.weight" for layer in layers}
    if getattr(source.config, "tie_word_embeddings", False):
        consumed.add("lm_head.weight")  # saved once, as the embedding
    for name in sorted(names - consumed):
        t = source.load([name], device)[name]
        report.source_params += t.numel()
        writer.add(name, t.to(torch.bfloat16) if t.is_floating_point() else t)
    writer.close()

    config = source.config
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp)
    add_quantization_config(tmp, ignore=[*KEEP_DENSE, *report.skipped])
    source.save_extras(tmp)

    report.checkpoint_bytes = writer.total_bytes
    result = report.to_dict()
    (tmp / REPORT_NAME).write_text(json.dumps(result, indent=2))
    return result
