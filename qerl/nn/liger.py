"""Liger-Kernel's fused RMSNorm and SwiGLU in the training forward on a GPU.

In a training forward Hugging Face's RMSNorm is ~7 kernels over [tokens, hidden] (casts to
fp32 and back, square, mean, two products; with AQN's fp32 weight a third cast) and the
MLP's silu(gate) * up two more over [tokens, intermediate], each again in the backward and,
with gradient checkpointing, in the recompute. Liger's ops do each in one pass. They are
bound to the model's own norm and MLP instances and chosen per call: only under autocast
on CUDA (the trainer's forward), while every other forward (the rollout engine's, which
has its own kernels, evaluation, CPU) runs the module's own. Unlike Liger's
``apply_liger_kernel_to_*``, nothing is replaced for the whole process, so models built
later are untouched.
"""

from __future__ import annotations

import importlib.util
from types import MethodType

import torch
from torch import nn

from qerl.settings import ConfigError


def _training_on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.is_autocast_enabled("cuda")


def _norm_forward(self, hidden: torch.Tensor) -> torch.Tensor:
    if not _training_on_gpu(hidden):
        return type(self).forward(self, hidden)
    from liger_kernel.transformers.functional import liger_rms_norm

    # "llama" casting is Qwen2's and Llama's: fp32 statistics, the normalized input rounded
    # to its dtype, then times the weight (in fp32 when AQN keeps it so). Not in place:
    # the output's gradient may be shared.
    return liger_rms_norm(hidden, self.weight, self.variance_epsilon, casting_mode="llama",
                          in_place=False)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not _training_on_gpu(x):
        return type(self).forward(self, x)
    from liger_kernel.transformers.functional import liger_swiglu

    return self.down_proj(liger_swiglu(self.gate_proj(x), self.up_proj(x)))


# What a Qwen2/Llama block is, for these ops and for the rollout decoder's kernels.
def is_rms_norm(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm")
            and getattr(module, "variance_epsilon", None) is not None
            and isinstance(getattr(module, "weight", None), torch.Tensor))


def is_swiglu_mlp(module: nn.Module) -> bool:
    # SiLUActivation: transformers' own class (5.x), not a subclass of nn.SiLU.
    return (all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"))


def require_liger() -> None:
    """Refuse, naming the fix, where Liger-Kernel is missing: its ops are imported at the
    first training forward, which would otherwise fail deep inside the model."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("train.liger is on but Liger-Kernel is not installed: pip install "
                          "'liger-kernel>=0.6' (qerl depends on it on Linux), or set "
                          "train.liger: false")


def use_liger(model: nn.Module) -> int:
    """Bind the dispatching forwards to ``model``'s RMSNorms and SwiGLU MLPs; returns how
    many modules now have them."""
    bound = 0
    for module in model.modules():
        if is_rms_norm(module):
            module.forward = MethodType(_norm_forward, module)
        elif is_swiglu_mlp(module):
            module.forward = MethodType(_mlp_forward, module)
        else:
            continue
        bound += 1
    return bound
