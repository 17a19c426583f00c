"""Real Qwen2.5 architectures (the Instruct models' config.json fields), shipped as data,
and tiny-llama: SmolLM2-135M's vocabulary and layout at 2 layers of width 64 (the smoke
workflow's model, with SmolLM2's tokenizer; weights drawn with std 0.3, so that its
next-token distributions are far from uniform and quantization visibly changes them).

Used to build paper-scale models with random weights: speed and memory do not depend on
the weights' values. Sources: the Qwen2.5 *-Instruct config.json files on the model hub.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import TYPE_CHECKING

from qerl.errors import ArchitectureError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MODEL_TYPES = ("qwen2", "llama")  # transformers' names of Qwen2.5's and SmolLM2's layout
# Their decoder layers' projections, which quantization and LoRA target.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def known() -> list[str]:
    """Names accepted by ``config_for``, e.g. ``qwen2.5-7b``."""
    files = resources.files(__name__).iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def fields(arch: str) -> dict:
    """A named architecture's config.json fields."""
    name = arch.lower()
    if name not in known():
        raise ArchitectureError(f"unknown architecture {arch!r}; known: {', '.join(known())}")
    return json.loads(resources.files(__name__).joinpath(f"{name}.json").read_text())


def config_for(arch: str) -> PretrainedConfig:
    """The transformers config of a named architecture."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**fields(arch))
