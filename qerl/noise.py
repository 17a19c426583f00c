"""Adaptive Quantization Noise (AQN): channel-wise Gaussian noise on the RMSNorm weights
that feed the quantized projections, decaying in stages over training.

Training is split into ``num_stages`` equal stages. Stage 0 adds nothing; stage i >= 1 uses

    sigma_i = sigma_start * (sigma_end / sigma_start) ** ((i - 1) / (num_stages - 2))

(sigma_start alone when num_stages == 2). At every optimizer step a fresh
Z ~ N(0, sigma^2), one value per channel, is added to each input_layernorm and
post_attention_layernorm weight and taken off again before the optimizer updates them, so
noise never accumulates and trainable norms learn on their clean values. An RMSNorm weight
scales the input channels of the projections after it, so this is the paper's noise on the
quantized weights, merged into the norm.

The protocol for a trainer, once per optimizer step:

    aqn.perturb(step)          # before sampling rollouts: the engine sees the noisy model
    ...rollouts...
    if aqn.settings.rollout_only:
        aqn.restore()          # the training forward sees the clean model
    ...training forward/backward...
    aqn.restore()              # always before optimizer.step()

By default the rollouts and that step's training forward see the same Z, so the policy
ratio compares like with like (the original applied noise to rollouts only: the switch).
Z depends only on (seed, step), so a resumed run draws the noise it would have drawn.

The perturbed norm weights are kept in fp32, their output cast back to the activations'
dtype: in bf16 a weight near 1 moves in steps of 2^-7, so w + Z with sigma below ~4e-3 (all
the late stages of 1e-2 -> 1e-4) would round back to w and the noise would vanish. With the
weight in fp32 the noise reaches the product and only the output is rounded, once, as
before; for Z = 0 the result is bit-identical to the bf16 norm (the product of two bf16
numbers is exact in fp32).
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from torch import nn

from qerl.errors import QerlError
from qerl.settings import Settings

NOISY_NORMS = ("input_layernorm", "post_attention_layernorm")


class AQNError(QerlError):
    """Bad AQN settings or protocol misuse."""


class AQNSettings(Settings):
    """sigma_start -> sigma_end over num_stages (stage 0 noise-free); defaults as the
    paper's runs used. ``rollout_only``: the noise reaches the rollouts but not the
    training forward (the original's choice)."""

    sigma_start: float = Field(1e-2, gt=0)
    sigma_end: float = Field(1e-4, gt=0)
    num_stages: int = Field(10, ge=2)  # stage 0 is noise-free
    rollout_only: bool = False

    @model_validator(mode="after")
    def _decays(self) -> AQNSettings:
        if self.sigma_end > self.sigma_start:
            raise ValueError("AQN needs sigma_end <= sigma_start, got sigma_start="
                             f"{self.sigma_start}, sigma_end={self.sigma_end}")
        return self

    def sigma(self, stage: int) -> float:
        """The noise level of ``stage`` (0 for stage 0)."""
        if not 0 <= stage < self.num_stages:
            raise AQNError(f"stage {stage} outside 0..{self.num_stages - 1}")
        if stage == 0:
            return 0.0
        if self.num_stages == 2:
            return self.sigma_start
        ratio = self.sigma_end / self.sigma_start
        return self.sigma_start * ratio ** ((stage - 1) / (self.num_stages - 2))

    def stage(self, step: int, total_steps: int) -> int:
        """The stage of optimizer step ``step`` (0-based) of ``total_steps``."""
        if total_steps < 1 or not 0 <= step < total_steps:
            raise AQNError(f"step {step} outside 0..{total_steps - 1}")
        return min(self.num_stages - 1, step * self.num_stages // total_steps)


def noisy_norms(model: nn.Module) -> dict[str, nn.Module]:
    """The RMSNorms AQN perturbs (those feeding attention and MLP projections), by module
    name, in model order."""
    return {name: module for name, module in model.named_modules()
            if name.rpartition(".")[2] in NOISY_NORMS
            and type(module).__name__.endswith("RMSNorm")}


def noisy_norm_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: module.weight for name, module in noisy_norms(model).items()}


def output_in_input_dtype(module, args, output):
    return output.to(args[0].dtype)


class AdaptiveQuantizationNoise:
    """AQN on ``model`` for a run of ``total_steps`` optimizer steps, its noise drawn from
    ``seed`` (see the module docstring for the protocol)."""

    def __init__(self, model: nn.Module, settings: AQNSettings, total_steps: int,
                 seed: int = 0):
        if total_steps < 1:
            raise AQNError(f"total_steps must be >= 1, got {total_steps}")
        self.settings = settings
        self.total_steps = total_steps
        self.seed = seed
        norms = noisy_norms(model)
        if not norms:
            raise AQNError(f"no {' or '.join(NOISY_NORMS)} RMSNorm in the model: AQN has "
                           "nothing to perturb")
        for module in norms.values():
            if module.weight.dtype != torch.float32:  # once per model (see the docstring)
                module.weight.data = module.weight.data.float()
                module.register_forward_hook(output_in_input_dtype)
        self.weights = {name: module.weight for name, module in norms.items()}
        self._clean: dict[str, torch.Tensor] | None = None
        self.step: int | None = None
        self.sigma = 0.0  # of the current (or last) step, for logging

    @property
    def perturbed(self) -> bool:
        return self._clean is not None

    def noise(self, step: int) -> dict[str, torch.Tensor]:
        """The Z of optimizer step ``step`` for each norm weight (zeros in stage 0)."""
        sigma = self.settings.sigma(self.settings.stage(step, self.total_steps))
        out = {}
        for i, (name, w) in enumerate(self.weights.items()):
            gen = torch.Generator(device=w.device)
            gen.manual_seed(((self.seed * 1_000_003 + step) * 1_009 + i) % (1 << 63))
            z = torch.randn(w.shape, generator=gen, device=w.device, dtype=torch.float32)
            out[name] = (z * sigma).to(w.dtype)
        return out

    def perturb(self, step: int) -> float:
        """Add step ``step``'s fresh noise to every norm weight; return its sigma."""
        if self.perturbed:
            raise AQNError(f"AQN is already applied (step {self.step}); restore() first")
        self.step = step
        self.sigma = self.settings.sigma(self.settings.stage(step, self.total_steps))
        self._clean = {name: w.detach().clone() for name, w in self.weights.items()}
        if self.sigma > 0:  # stage 0 leaves the weights untouched, bit for bit
            with torch.no_grad():
                for name, z in self.noise(step).items():
                    self.weights[name].add_(z)
        return self.sigma

    def restore(self) -> None:
        """Put the clean weights back (a no-op when no noise is applied)."""
        if self._clean is None:
            return
        with torch.no_grad():
            for name, clean in self._clean.items():
                self.weights[name].copy_(clean)
        self._clean = None
