"""LoRA on NVFP4Linear through PEFT's custom-module support.

The layer reuses PEFT's own LoRA Linear (its forward, dropout, scaling and adapter dtype
handling), so that the same adapter gives the same numbers on an NVFP4 base as on the BF16
one, up to the base weights' quantization. Only what needs the dense base weight differs:
merging into a 4-bit weight cannot be done in place (export a merged BF16 model instead).
"""

from __future__ import annotations

from peft import LoraConfig
from peft.tuners.lora.layer import Linear as PeftLoraLinear

from qerl.errors import QerlError
from qerl.nn.nvfp4_linear import NVFP4Linear


class NVFP4LoraLinear(PeftLoraLinear):
    """PEFT LoRA layer whose base is a frozen NVFP4Linear."""

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise QerlError("a LoRA adapter cannot be merged into an NVFP4 weight in place; "
                        "export a merged BF16 model (qerl.export.merged_model) instead")

    def unmerge(self) -> None:
        raise QerlError("an NVFP4 base is never merged, so there is nothing to unmerge")


def register_nvfp4(config: LoraConfig) -> LoraConfig:
    """Let ``config`` put LoRA on NVFP4Linear layers (PEFT's experimental custom-module API;
    not saved with the adapter, so a reload onto an NVFP4 base registers again)."""
    config._register_custom_module({NVFP4Linear: NVFP4LoraLinear})
    return config
