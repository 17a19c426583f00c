"""An RL step fitted to a memory budget (``memory_gb`` in the training configuration; `qerl
train --memory-gb`, `qerl bench step --memory-gb`), planned from the model's shape before
any model is built.

The plan keeps what the step learns from (its completions, their lengths, the LoRA rank,
the optimizer) and chooses how the step runs: gradient checkpointing on (the footprint's
activation terms are those of checkpointed steps), the most rollout sequences the KV cache
can hold beside the smallest training micro-batch (the rollout decodes token by token, so
a step's time goes mostly to how many rounds of it there are), then the largest micro-batch
that divides the step's completions, up to ``train.batch_size``, in what is left. Where
the rollout would take more than one round, the plan takes MEASURES (the input embedding
and the optimizer's state in the host's memory, the KV cache freed while training),
cheapest first, each only if it saves a round. The
log-probabilities are TRL's fused LM head's, always computed in tiles (qerl.rl.footprint,
``logprob``): there is no chunk to choose. A step that cannot fit even at one sequence a
rollout and a micro-batch of one is refused with its terms and the smallest budget that
would hold it.

The budget counts memory as the driver sees it: the footprint (torch's allocated peak),
ALLOCATOR_SLACK of it for what torch's allocator holds but cannot hand out, and
CUDA_CONTEXT_GB, an assumed allowance for what the driver holds outside torch. On a GPU it
is enforced: torch's allocator is capped at the budget less the context allowance
(``torch.cuda.set_per_process_memory_fraction``), so a run that exceeds its plan fails
with torch's out-of-memory error instead of using more. On a CPU it is planned, not
enforced: the same settings are applied, so a CPU run rehearses a GPU run's (the tests
do), but nothing caps the host's memory, whose use (fp32 weights, no fused kernels) the
footprint does not model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from qerl.config import TrainConfig
from qerl.formats.kv_cache import DEFAULT as DEFAULT_KV_CACHE
from qerl.rl.footprint import GB, Step, step_memory
from qerl.settings import ConfigError

# What the driver holds for a process outside torch's allocator: the CUDA context, cuBLAS's
# handles and the kernels' modules (ours, Triton's, torch's). Measured by every row of
# `qerl bench budget` (nvml_peak_gb - torch_reserved_gb, results/tables/budget.md): on the
# H100 and the H200 a little under this allowance, steps and capped builds alike; a
# consumer card's driver is not measured, hence the margin.
CUDA_CONTEXT_GB = 1.0
# The allocator's slack, a fraction of the footprint: memory torch holds but cannot hand
# out (blocks split by earlier tensors), which counts against its cap, and what the
# footprint misses. The capped runs (results/bench/budget_*.csv) ran out of memory with a
# few percent of the cap reserved beyond what was allocated (torch_reserved_gb -
# torch_peak_gb), fewer with expandable segments than without; and the one capped 7B step
# that ran (H200, 10 GB, micro-batch 1) allocated more than its footprint by about as
# much again. Not measured at 14B and up.
ALLOCATOR_SLACK = 0.10
# What a plan may take beyond its batch sizes, cheapest first (configuration keys): the
# input embedding in the host's memory (a forward gathers its rows over PCIe), the KV cache
# freed after each step's rollouts (its decode graphs are captured again each step), the
# optimizer's moments in the host's memory (its step runs on the CPU), the layer inputs
# checkpointing keeps in the host's memory (copied out and back each micro-batch).
MEASURES = ("offload.embedding", "engine.release_cache", "offload.optimizer",
            "offload.activations")
STEP_FIELDS = {"offload.embedding": "embedding_on_host",
               "engine.release_cache": "cache_released",
               "offload.optimizer": "optimizer_on_host",
               "offload.activations": "activations_on_host"}


def with_measures(model_config, step: Step, measures: tuple[str, ...]) -> dict[str, float]:
    """The footprint terms (GB) of ``step`` of a model of ``model_config`` with
    ``measures`` (MEASURES) taken."""
    return step_memory(model_config, replace(step, **{STEP_FIELDS[m]: True for m in measures}))


def measures_label(measures: tuple[str, ...]) -> str:
    """``measures`` as a row names them: "+"-joined, or none."""
    return "+".join(measures) or "none"


class BudgetError(ConfigError):
    """A step that does not fit its memory budget, or a budget that cannot be enforced."""


class DoesNotFit(BudgetError):
    """A step that does not fit its budget even at its smallest settings; ``needs_gb``,
    the smallest budget that would hold it."""

    def __init__(self, message: str, needs_gb: float):
        super().__init__(message)
        self.needs_gb = needs_gb


@dataclass(frozen=True)
class Plan:
    """How a step runs within ``budget_gb``: ``rollout_batch`` sequences a rollout (the KV
    cache's rows), ``micro_batch`` sequences a forward and backward of ``completions`` a
    step, gradient checkpointing on, and the MEASURES in ``measures``; ``terms``, the
    footprint at those settings (GB)."""

    budget_gb: float
    context_gb: float
    completions: int
    rollout_batch: int
    micro_batch: int
    terms: dict[str, float]
    measures: tuple[str, ...] = ()
    kv_cache: str = DEFAULT_KV_CACHE

    @property
    def needs_gb(self) -> float:
        return driver_gb(self.terms, self.context_gb)

    @property
    def rollout_rounds(self) -> int:
        return -(-self.completions // self.rollout_batch)

    def describe(self) -> str:
        return (f"memory budget {self.budget_gb:g} GB: {self.rollout_batch} of the step's "
                f"{self.completions} sequences a rollout ({self.rollout_rounds} round(s)), "
                f"micro-batch {self.micro_batch}, gradient checkpointing, a {self.kv_cache} "
                f"KV cache"
                f"{''.join(f', {m}' for m in self.measures)}; estimated "
                f"{self.needs_gb:.2f} GB; {breakdown(self.terms, self.context_gb)}")

    def as_dict(self) -> dict:
        return {"budget_gb": self.budget_gb, "context_gb": self.context_gb,
                "context_measured": False, "completions": self.completions,
                "rollout_batch": self.rollout_batch, "micro_batch": self.micro_batch,
                "gradient_checkpointing": True, "measures": list(self.measures),
                "kv_cache": self.kv_cache,
                "needs_gb": round(self.needs_gb, 3),
                **{f"{k}_gb": round(v, 3) for k, v in self.terms.items()}}


def driver_gb(terms: dict[str, float], context_gb: float) -> float:
    """What a footprint's ``terms`` take as the driver counts them: the footprint, the
    allocator's slack on it and the CUDA context allowance."""
    return terms["total"] * (1 + ALLOCATOR_SLACK) + context_gb


def breakdown(terms: dict[str, float], context_gb: float) -> str:
    """The terms of a footprint as a sentence."""
    activations = terms["checkpointed"] + max(terms["layer"], terms["logprob"])
    return (f"in GB, weights {terms['weights']:.2f}, LoRA and optimizer {terms['lora']:.2f}, "
            f"KV cache {terms['kv_cache']:.2f}, activations {activations:.2f} (checkpointed "
            f"inputs {terms['checkpointed']:.2f}, then the larger of one layer's recompute "
            f"{terms['layer']:.2f} and the log-prob tiles {terms['logprob']:.2f}), the "
            f"allocator's slack {terms['total'] * ALLOCATOR_SLACK:.2f} "
            f"({ALLOCATOR_SLACK:.0%} of those) and a CUDA context allowance of "
            f"{context_gb:.2f}")


def measures_for(model_config, optimizer: str) -> tuple[str, ...]:
    """The MEASURES a model of ``model_config`` trained by ``optimizer`` can take."""
    tied = getattr(model_config, "tie_word_embeddings", False)
    return tuple(m for m in MEASURES
                 if not (m == "offload.embedding" and tied)
                 and not (m == "offload.optimizer" and optimizer != "adamw_torch"))


def plan_step(model_config, *, budget_gb: float, method: str, completions: int,
              max_micro_batch: int, prompt_len: int, completion: int, rank: int,
              optimizer: str = "adamw_torch", kv_cache: str = DEFAULT_KV_CACHE,
              context_gb: float = CUDA_CONTEXT_GB) -> Plan:
    """The plan of a step of ``completions`` sequences of a model of ``model_config`` (a
    transformers config) within ``budget_gb``, its KV cache in the format ``kv_cache``
    (engine.kv_cache: the user's choice, never one of the MEASURES, since it changes what
    is sampled); DoesNotFit where none does."""
    if budget_gb <= 0 or completions < 1 or max_micro_batch < 1:
        raise BudgetError(f"a plan needs a positive budget, completions and micro-batch; got "
                          f"{budget_gb} GB, {completions}, {max_micro_batch}")

    def needs(measures: tuple[str, ...], sequences: int, micro_batch: int) -> dict[str, float]:
        return with_measures(model_config, Step(method, sequences, micro_batch, prompt_len,
                                                completion, rank, optimizer,
                                                kv_cache=kv_cache), measures)

    def fits(measures: tuple[str, ...], sequences: int, micro_batch: int) -> bool:
        return driver_gb(needs(measures, sequences, micro_batch), context_gb) <= budget_gb

    def planned(measures: tuple[str, ...]) -> Plan | None:
        if not fits(measures, 1, 1):
            return None
        # The KV cache first: the largest rollout batch beside a micro-batch of one, evened
        # out over the rounds it takes (5 + 3 of 8 as 4 + 4: as fast, and the rest to
        # training).
        rollout = max(r for r in range(1, completions + 1) if fits(measures, r, 1))
        rounds = -(-completions // rollout)
        rollout = -(-completions // rounds)
        micro = max(m for m in range(1, min(max_micro_batch, completions) + 1)
                    if completions % m == 0 and fits(measures, rollout, m))
        return Plan(budget_gb, context_gb, completions, rollout, micro,
                    needs(measures, rollout, micro), measures, kv_cache)

    # A measure is taken only where it saves the rollout a round, the cheapest first.
    options, best = measures_for(model_config, optimizer), None
    for taken in range(len(options) + 1):
        plan = planned(options[:taken])
        if plan is not None and (best is None or plan.rollout_rounds < best.rollout_rounds):
            best = plan
        if best is not None and best.rollout_rounds == 1:
            break
    if best is None:
        smallest = needs(options, 1, 1)
        least = math.ceil(driver_gb(smallest, context_gb) * 100) / 100
        taken = f" and {', '.join(options)}" if options else ""
        raise DoesNotFit(
            f"a {method} step of {completions} sequences of {prompt_len} + {completion} "
            f"tokens (prompt + completion; LoRA rank {rank}, {optimizer}, a {kv_cache} KV "
            f"cache) does not fit "
            f"memory_gb {budget_gb:g}: at the smallest settings (1 sequence a rollout, "
            f"micro-batch 1, gradient checkpointing{taken}) it needs {least:.2f} GB; "
            f"{breakdown(smallest, context_gb)}. The smallest budget that fits: {least:.2f} GB",
            least)
    return best


def fit(config: TrainConfig, model_config) -> tuple[TrainConfig, Plan]:
    """``config`` planned into its ``memory_gb`` (a model of ``model_config``): the same
    completions a step, in the plan's micro-batches and rollout batches, with gradient
    checkpointing and the plan's measures."""
    if config.memory_gb is None:
        raise BudgetError("the configuration sets no memory_gb to fit")
    train, rl = config.train, config.rl
    completions = train.batch_size * train.gradient_accumulation_steps
    plan = plan_step(model_config, budget_gb=config.memory_gb, method=config.method,
                     completions=completions, max_micro_batch=train.batch_size,
                     prompt_len=rl.max_prompt_length, completion=rl.max_completion_length,
                     rank=config.lora.rank, optimizer=train.optimizer,
                     kv_cache=config.engine.kv_cache)
    planned = config.model_copy(update={
        "train": train.model_copy(update={
            "batch_size": plan.micro_batch, "gradient_checkpointing": True,
            "gradient_accumulation_steps": completions // plan.micro_batch}),
        "engine": config.engine.model_copy(update={
            "max_batch": plan.rollout_batch,
            "release_cache": "engine.release_cache" in plan.measures}),
        "offload": config.offload.model_copy(update={
            "embedding": "offload.embedding" in plan.measures,
            "optimizer": "offload.optimizer" in plan.measures,
            "activations": "offload.activations" in plan.measures})})
    return planned, plan


def enforce(plan: Plan, device) -> str:
    """Cap torch's allocator on the CUDA ``device`` at the plan's budget less its context
    allowance; what was done, as a sentence for the log."""
    import torch

    device = torch.device(device)
    if device.index is None:  # "cuda": set_per_process_memory_fraction needs its index
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory / GB
    if plan.budget_gb > total:
        raise BudgetError(f"memory_gb {plan.budget_gb:g} is more than {device} holds "
                          f"({total:.2f} GB)")
    fraction = (plan.budget_gb - plan.context_gb) / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    # Segments that grow in place instead of blocks split by earlier tensors: the first
    # capped 7B run at 8 GB (H100, results/bench/budget_*.csv) ran out while building its
    # model with 0.93 GB held but unusable. The setting applies to segments made from now
    # on (the policy's first).
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (setter or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")
    return (f"enforced: torch.cuda.set_per_process_memory_fraction({fraction:.4f}) caps "
            f"torch's allocator on {device} at {fraction * total:.2f} of its {total:.2f} GB "
            f"(the budget less the CUDA context allowance of {plan.context_gb:.2f} GB), "
            f"with expandable segments")
