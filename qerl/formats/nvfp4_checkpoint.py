"""compressed-tensors ``nvfp4-pack-quantized`` checkpoints: write them shard by shard, and
read them back as packed tensors (never a BF16 copy of the model).

Layout of a checkpoint directory: config.json (with ``quantization_config``), safetensors
shards (``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json``), the tokenizer files, and ``quantization_report.json``.
Per quantized Linear ``X``: ``X.weight_packed`` u8 [N, K/2], ``X.weight_scale`` f8e4m3 [N, K/16]
and ``X.weight_global_scale`` f32 [1].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationStatus,
    preset_name_to_scheme,
)
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from qerl.errors import CheckpointError, QuantizationError
from qerl.formats.nvfp4 import NVFP4Tensor

FORMAT = "nvfp4-pack-quantized"
INDEX_NAME = "model.safetensors.index.json"
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")


def quantization_config(ignore: list[str]) -> QuantizationConfig:
    """The NVFP4A16 config llmcompressor writes: every Linear but ``ignore``."""
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    scheme.format = FORMAT
    # Weights are calibrated once from their own min/max, which llmcompressor records so.
    scheme.weights.observer = "memoryless_minmax"
    return QuantizationConfig(
        config_groups={"group_0": scheme},
        format=FORMAT,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore,
    )


def add_quantization_config(directory: Path, ignore: list[str]) -> None:
    """Write ``quantization_config`` into ``directory/config.json`` as compressed-tensors does."""
    ModelCompressor(quantization_config=quantization_config(ignore)).update_config(str(directory))


class ShardWriter:
    """Writes tensors into safetensors shards of at most ``max_shard_bytes`` as they come,
    so that only one shard is ever held in memory."""

    def __init__(self, directory: Path, max_shard_bytes: int = 2 << 30):
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = self.directory / f"shard-{len(self._shards)}.tmp"
        save_file(self._pending, path, {"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        """Give the shards their final names and write the index if there are several."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            (self.directory / "shard-0.tmp").rename(self.directory / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.directory / f"shard-{i}.tmp").rename(self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))


def read_json(path: Path) -> dict:
    """A JSON file's contents, or a CheckpointError naming the file and the cause."""
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the file is corrupt") from e


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = directory / INDEX_NAME
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'")
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {directory}")
    return {name: file for file in files for name in tensor_names(file)}


def _open(file: Path):
    if not file.is_file():
        raise CheckpointError(f"missing file: {file}")
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file ({e})") from e


def tensor_names(file: Path) -> list[str]:
    with _open(file) as f:
        return list(f.keys())


def load_tensors(file: Path, names: list[str], device: str | torch.device = "cpu"):
    """Load ``names`` from one safetensors file; the file is closed (unmapped) afterwards."""
    with _open(file) as f:
        missing = set(names) - set(f.keys())
        if missing:
            raise CheckpointError(f"{file} lacks tensor(s) {sorted(missing)}")
        try:
            return {name: f.get_tensor(name).to(device) for name in names}
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{file}: cannot read tensor data ({e}); truncated?") from e


@dataclass
class NVFP4Checkpoint:
    """A checkpoint read back: quantized Linears as packed tensors, everything else dense."""

    config: dict
    quantized: dict[str, NVFP4Tensor]  # module name (e.g. model.layers.0.mlp.up_proj) -> weight
    dense: dict[str, torch.Tensor]  # tensor name -> tensor (embeddings, norms, biases, lm_head)

    @property
    def ignore(self) -> list[str]:
        return list(self.config["quantization_config"].get("ignore") or [])


def check_quantization_config(config: dict, path: Path) -> None:
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{path}: no quantization_config; not a quantized checkpoint")
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: quantization_config is {qc.get('quant_method')!r}/{qc.get('format')!r}, "
            f"expected 'compressed-tensors'/{FORMAT!r}"
        )
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", 16):
            raise CheckpointError(f"{path}: config group {name!r} is not NVFP4 weights: {w}")


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu") -> NVFP4Checkpoint:
    """Read an NVFP4 checkpoint, one shard at a time, as packed tensors on ``device``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"no such checkpoint directory: {directory}")
    config = read_json(directory / "config.json")
    check_quantization_config(config, directory / "config.json")
    by_file: dict[Path, list[str]] = {}
    for name, file in weight_files(directory).items():
        by_file.setdefault(file, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        tensors.update(load_tensors(file, names, device))

    modules = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_packed")}
    quantized = {}
    for module in sorted(modules):
        parts = [tensors.pop(f"{module}.{suffix}", None) for suffix in PACKED_SUFFIXES]
        if any(p is None for p in parts):
            raise CheckpointError(f"{directory}: {module} lacks one of {PACKED_SUFFIXES}")
        try:
            quantized[module] = NVFP4Tensor(*parts)
        except QuantizationError as e:
            raise CheckpointError(f"{directory}: {module}: {e}") from e
    return NVFP4Checkpoint(config=config, quantized=quantized, dense=tensors)
