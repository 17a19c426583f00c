"""The training configuration: a YAML file checked in full before any work starts.

Unknown keys, wrong types and impossible combinations are refused with the key's path
(``rl.num_generations: ...``). Defaults are the original's DAPO-style GSM8K run
(DESIGN: beta 0, epsilon 0.2 / 0.28, token-level loss, truncated completions masked,
LoRA r16, lr 1e-5, AdamW betas (0.9, 0.99), weight decay 0.1, warmup 0.1, cosine, grad
clip 0.2). The sections are the settings the library itself takes (LoraSettings here,
AQNSettings in qerl.noise), so each default is written once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from qerl.archs import PROJECTIONS
from qerl.formats import kv_cache as kv_formats
from qerl.methods import Method
from qerl.noise import AQNSettings
from qerl.settings import ConfigError as ConfigError  # where callers have found it
from qerl.settings import Settings, describe, describe_errors


class LoraSettings(Settings):
    """LoRA as the original's scripts set it (r 16, alpha 16, all projections); the paper's
    Table 4 uses rank 32. ``train_norms`` also trains every RMSNorm weight."""

    rank: int = Field(16, ge=1)
    alpha: float = Field(16, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = Field(PROJECTIONS, min_length=1)
    train_norms: bool = False


class AQNSection(AQNSettings):
    enabled: bool | None = None  # None: on for qerl, off for the baselines


class DataSection(Settings):
    task: str = "gsm8k"
    path: Path | None = None
    split: str = "train"
    limit: int | None = Field(None, ge=1)
    level: int = Field(1, ge=1, le=5)  # arithmetic only
    size: int = Field(1024, ge=1)  # arithmetic only


class OverlongSection(Settings):
    """DAPO's soft overlong punishment: 0 up to max_completion_length - buffer, then a
    linear ramp to -penalty at max_completion_length."""

    enabled: bool = False
    buffer: int = Field(256, ge=1)
    penalty: float = Field(1.0, ge=0)


class RLSection(Settings):
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = "dapo"
    beta: float = Field(0.0, ge=0)
    epsilon: float = Field(0.2, gt=0)
    epsilon_high: float = Field(0.28, gt=0)
    num_iterations: int = Field(1, ge=1)
    num_generations: int = Field(8, ge=2)
    mask_truncated_completions: bool = True
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_prompt_length: int = Field(256, ge=1)
    max_completion_length: int = Field(2048, ge=1)
    dynamic_sampling: bool = False
    max_refills: int = Field(3, ge=0)
    overlong: OverlongSection = OverlongSection()
    rewards: dict[Literal["accuracy", "format"], float] = Field(
        default_factory=lambda: {"accuracy": 1.0, "format": 0.1})
    # Truncated importance sampling of the sampler/trainer mismatch (TRL's correction: each
    # token's loss times min(p_train / p_sampler, tis_cap)); None: on for engine.backend
    # vllm and engine.kv_cache fp8, off for the embedded engine with the model's dtype, whose
    # log-probs are the policy's own forward.
    tis: bool | None = None
    tis_cap: float = Field(3.0, gt=0)


class TrainSection(Settings):
    max_steps: int = Field(100, ge=1)
    batch_size: int = Field(16, ge=1)  # completions per device per optimizer micro-step
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(1e-5, gt=0)
    optimizer: Literal["adamw_torch", "adamw_8bit"] = "adamw_torch"
    weight_decay: float = Field(0.1, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.99, ge=0, lt=1)
    warmup_ratio: float = Field(0.1, ge=0, lt=1)  # of max_steps
    lr_scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup"] = "cosine"
    max_grad_norm: float = Field(0.2, gt=0)
    gradient_checkpointing: bool = False
    # Liger-Kernel's fused RMSNorm and SwiGLU in the training forward on a GPU (qerl.nn.liger).
    liger: bool = True
    save_steps: int = Field(10, ge=1)
    # Checkpoints kept, the newest (two: a resume still has one if the last save was cut
    # short). A full fine-tune's hold its optimizer state, tens of GB each at 7B. None: all.
    save_total_limit: int | None = Field(2, ge=1)
    logging_steps: int = Field(1, ge=1)
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["tensorboard"])


class EngineSection(Settings):
    backend: Literal["embedded", "vllm"] = "embedded"
    kv_budget_gb: float | None = Field(None, gt=0)
    # Sequences a rollout samples at once (a step's more run in rounds); None: all of them,
    # or as many as kv_budget_gb holds. memory_gb sets it.
    max_batch: int | None = Field(None, ge=1)
    # Free the KV cache (and the decode step's CUDA graphs) after each step's rollouts, so
    # that training has its memory; they are made again at the next step's. memory_gb may
    # set it.
    release_cache: bool = False
    # The KV cache's keys and values: in the model's dtype (bf16), or in 8 bits with a scale
    # per (layer, sequence, kv head), half the bytes a token (qerl/formats/kv_cache.py).
    kv_cache: kv_formats.KVCacheFormat = kv_formats.DEFAULT


class OffloadSection(Settings):
    """What lives in the host's memory instead of the GPU's; memory_gb may set each."""

    # The input embedding's table, pinned, its rows gathered over PCIe (an untied one: a
    # tied table is also the lm_head's).
    embedding: bool = False
    # AdamW's fp32 master weights and moments, its step on the CPU (train.optimizer
    # adamw_torch).
    optimizer: bool = False
    # The layer inputs gradient checkpointing keeps for the backward's recompute, pinned
    # (transformers' gradient_checkpointing offload): copied out in the forward, back in the
    # backward, on the compute stream (train.gradient_checkpointing; on a CPU they are in
    # host memory already).
    activations: bool = False


class TrainConfig(Settings):
    model: str | None = None  # directory, hub id, .gguf, NVFP4 checkpoint
    arch: str | None = None  # random weights of a known shape (benchmarks)
    tokenizer: str | None = None  # where the tokenizer lives, if not with the model
    method: Method = "qerl"
    output_dir: Path
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    lora: LoraSettings = LoraSettings()
    aqn: AQNSection = AQNSection()
    data: DataSection = DataSection()
    rl: RLSection = RLSection()
    train: TrainSection = TrainSection()
    engine: EngineSection = EngineSection()
    offload: OffloadSection = OffloadSection()
    # GPU memory (decimal GB, as the driver counts it) one process's step must fit: the
    # micro-batch (at most train.batch_size), the rollout's batch and gradient checkpointing
    # are chosen for it, and on a GPU torch is capped to it (qerl.rl.budget).
    memory_gb: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if (self.model is None) == (self.arch is None):
            raise ValueError("give exactly one of model and arch")
        # A step's rollouts (batch_size x gradient_accumulation_steps completions, sampled
        # at once) hold whole groups; a micro-batch may cut through one.
        rollouts = self.train.batch_size * self.train.gradient_accumulation_steps
        if rollouts % self.rl.num_generations:
            raise ValueError(f"train.batch_size x train.gradient_accumulation_steps ({rollouts}) "
                             f"must be a multiple of rl.num_generations "
                             f"({self.rl.num_generations}): each prompt's completions are "
                             "one group")
        if self.rl.overlong.enabled and self.rl.overlong.buffer >= self.rl.max_completion_length:
            raise ValueError("rl.overlong.buffer must be below rl.max_completion_length")
        if self.memory_gb is not None:
            self._check_budget()
        if self.offload.optimizer and self.train.optimizer != "adamw_torch":
            raise ValueError(f"offload.optimizer keeps AdamW's state in fp32 on the host: "
                             f"train.optimizer adamw_torch, not {self.train.optimizer}")
        if self.offload.activations and not self.train.gradient_checkpointing:
            raise ValueError("offload.activations keeps gradient checkpointing's layer inputs "
                             "on the host: set train.gradient_checkpointing true")
        if self.offload.embedding and self.method == "full":
            raise ValueError("offload.embedding freezes the input embedding in host memory; "
                             "method full trains it")
        if self.engine.release_cache and self.engine.backend != "embedded":
            raise ValueError("engine.release_cache frees the embedded engine's cache; vLLM "
                             "keeps its own (engine.backend: embedded)")
        if self.engine.kv_cache != kv_formats.DEFAULT and self.engine.backend != "embedded":
            raise ValueError(f"engine.kv_cache {self.engine.kv_cache} is the embedded "
                             f"engine's cache; vLLM keeps its own (engine.backend: embedded)")
        if self.method == "full" and self.aqn.enabled is True:
            raise ValueError("AQN perturbs the norms of a quantized base; method full has "
                             "none to model: set aqn.enabled false")
        return self

    def _check_budget(self) -> None:
        if self.method == "full":
            raise ValueError("memory_gb plans the LoRA methods (qerl, lora, qlora); a full "
                             "fine-tune's memory is not modelled")
        if self.engine.backend != "embedded":
            raise ValueError("memory_gb sizes the embedded engine's KV cache; vLLM sizes its "
                             "own (engine.backend: embedded)")
        given = [k for k in ("kv_budget_gb", "max_batch") if getattr(self.engine, k) is not None]
        if given:
            raise ValueError(f"memory_gb sizes the rollout's KV cache itself: leave "
                             f"{', '.join(f'engine.{k}' for k in given)} unset")
        chosen = [k for k, on in (("engine.release_cache", self.engine.release_cache),
                                  ("offload.embedding", self.offload.embedding),
                                  ("offload.optimizer", self.offload.optimizer),
                                  ("offload.activations", self.offload.activations)) if on]
        if chosen:
            raise ValueError(f"memory_gb takes the memory measures where they are needed: "
                             f"leave {', '.join(chosen)} unset")


def load_config(path: str | Path, overrides: dict | None = None) -> TrainConfig:
    """The checked configuration in ``path`` (YAML), with ``overrides`` (a nested dict)
    applied on top."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of settings, not {type(raw).__name__}")
    overrides = overrides or {}
    try:
        return TrainConfig.model_validate(_merge(raw, overrides))
    except ValidationError as e:
        # A problem on the way to, at or under a key that --set gave is the flag's.
        paths = list(_leaf_paths(overrides))
        errors = e.errors()
        given = [err for err in errors if any(_related(tuple(map(str, err["loc"])), p)
                                              for p in paths)]
        parts = [f"--set {describe_errors(given)}"] if given else []
        rest = [err for err in errors if err not in given]
        if rest:
            parts.append(f"{path}: {describe_errors(rest)}")
        raise ConfigError("; ".join(parts)) from None


def _related(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether one key path leads to the other."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _leaf_paths(tree: dict, prefix: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaf_paths(value, (*prefix, str(key)))
        else:
            yield (*prefix, str(key))


def parse_config(raw: dict, where: str = "config") -> TrainConfig:
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{where}: {describe(e)}") from None


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (_merge(out[key], value) if isinstance(value, dict)
                    and isinstance(out.get(key), dict) else value)
    return out
