"""The methods qerl trains and compares, named once: QeRL (a frozen NVFP4 base + LoRA) and
the paper's baselines, LoRA on a BF16 base, QLoRA (an NF4 base) and full fine-tuning."""

from __future__ import annotations

from typing import Literal

METHODS = ("qerl", "lora", "qlora", "full")
LORA_METHODS = METHODS[:3]  # adapters trained on a frozen base
Method = Literal[METHODS]
