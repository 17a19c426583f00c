"""Rollouts: batched sampling on the live policy (the embedded engine), or through vLLM."""

from qerl.rollout.engine import Engine, Rollout, RolloutError
from qerl.rollout.sampling_params import SamplingParams

__all__ = ["Engine", "Rollout", "RolloutError", "SamplingParams"]
