"""PEFT's LoRA Linear with one fast path: the training forward under autocast.

PEFT casts a projection's input to the adapter's dtype (fp32, PEFT's default) before the
adapter's matmuls, which autocast then cast straight back to bf16; the adapter's output then
takes a multiply by the scaling and an add to the base output. Each is a pass over a
[tokens, features] tensor, twice over with gradient checkpointing (two forwards and a
backward): at RL's thousands of tokens a micro-batch these passes cost more than the
adapters' matmuls. Under autocast this layer reads x as it is, and the GEMM itself adds
the adapter into the base output (result += scaling * (x A^T) B^T, in fp32, rounded once
instead of three times). Everything else — no autocast (evaluation, the rollout's
prefill), several or disabled adapters, variants such as DoRA, adapter biases, merged
weights — runs PEFT's own forward, which the fast path is tested against.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear


class LoraLinear(PeftLoraLinear):
    """PEFT's LoRA Linear; under autocast, the adapter added by the GEMM's epilogue."""

    def _fast_adapter(self, x: torch.Tensor, kwargs: dict) -> str | None:
        """The one active vanilla adapter, if this forward can take the fast path."""
        device = x.device.type
        if (not torch.is_autocast_enabled(device) or x.dtype != torch.get_autocast_dtype(device)
                or self.disable_adapters or self.merged or "adapter_names" in kwargs):
            return None
        active = [name for name in self.active_adapters if name in self.lora_A]
        if len(active) != 1:
            return None
        name = active[0]
        if name in self.lora_variant or self.lora_B[name].bias is not None:
            return None
        return name

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = self._fast_adapter(x, kwargs)
        if name is None:
            return super().forward(x, *args, **kwargs)
        # 2-D throughout, so that the in-place add below is on the base output itself (an
        # in-place op on a view of it would make autograd copy the gradient).
        x2 = x.reshape(-1, x.shape[-1])
        result = self.base_layer(x2, *args, **kwargs)
        xa = self.lora_A[name](self.lora_dropout[name](x2))
        xa, b = xa.to(result.dtype), self.lora_B[name].weight.to(result.dtype)
        scaling = self.scaling[name]
        if result._is_view():  # a base that returns a view of its own buffer (autograd
            # forbids writing into those): the GEMM adds into a copy.
            result = torch.addmm(result, xa, b.t(), alpha=scaling)
        else:
            # Nothing saved the base output for its backward (a linear keeps its input), so
            # it can be written in place; addmm_ is not an autocast op, hence the casts.
            result.addmm_(xa, b.t(), alpha=scaling)
        return result.view(*x.shape[:-1], result.shape[-1])
