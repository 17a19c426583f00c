"""LoRA on NVFP4Linear through PEFT's custom-module support.

The layer is the BF16 base's LoRA Linear (``qerl.nn.lora_linear``: PEFT's own, with its
fast path under autocast), so that the same adapter gives the same numbers on an NVFP4 base
as on the BF16 one, up to the base weights' quantization. Only what needs the dense base
weight differs: merging into a 4-bit weight cannot be done in place (export a merged BF16
model instead).
"""

from __future__ import annotations

from peft import LoraConfig
from torch import nn

from qerl.errors import QerlError
from qerl.nn.lora_linear import LoraLinear
from qerl.nn.nvfp4_linear import NVFP4Linear


class NVFP4LoraLinear(LoraLinear):
    """PEFT LoRA layer whose base is a frozen NVFP4Linear."""

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise QerlError("a LoRA adapter cannot be merged into an NVFP4 weight in place; "
                        "export a merged BF16 model (qerl.export.merged_model) instead")

    def unmerge(self) -> None:
        raise QerlError("an NVFP4 base is never merged, so there is nothing to unmerge")


def register_lora_layers(config: LoraConfig, nvfp4_base: bool) -> LoraConfig:
    """Let ``config`` put our LoRA layers on Linear (and NVFP4Linear) layers: PEFT's
    experimental custom-module API, not saved with the adapter, so a reload registers again.
    Not for a bitsandbytes base: its layers subclass nn.Linear, which the mapping matches by
    isinstance, and need PEFT's own LoRA layers."""
    config._register_custom_module({nn.Linear: LoraLinear})
    if nvfp4_base:
        config._register_custom_module({NVFP4Linear: NVFP4LoraLinear})
    return config
