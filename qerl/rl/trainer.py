"""GRPO/DAPO training on TRL's GRPOTrainer, with rollouts from the embedded engine.

TRL owns the loss and its bookkeeping (grpo | dapo | dr_grpo, epsilon/epsilon_high, beta,
num_iterations, mask_truncated_completions, the metrics); this subclass changes only what
the paper needs and TRL lacks:

- generation goes to ``qerl.rollout.Engine`` on the live policy (TRL's extension point
  ``_generate_single_turn``): NVFP4 kernels, unmerged LoRA and AQN's noise, no weight sync
  (or, with ``engine.backend: vllm``, to vLLM, which gets the adapter and norms pushed
  before each rollout);
- AQN: ``perturb(step)`` before the step's first micro-batch (its rollouts sample from the
  noised model), ``restore()`` before the optimizer step (or right after the rollouts,
  with ``aqn.rollout_only``);
- DAPO's overlong reward shaping (a reward function) and dynamic sampling (groups whose
  rewards all agree carry no signal: they are replaced by fresh prompts' groups);
- metrics TRL does not log: AQN sigma, rollout tokens/s, peak GPU memory, the threads of a
  CPU run (``qerl.cpu_threads``: each phase on the cores other processes leave idle), and the gap
  between the sampler's log-probs and the training forward's (``mismatch/*``), with TRL's
  truncated importance sampling of that gap switchable (``rl.tis``);
- a faster training forward: causal attention over padded batches without a mask
  (``qerl.nn.padded_attention``), Liger's fused norm and SwiGLU on GPU (``qerl.nn.liger``),
  and LoRA added inside the base GEMM (``qerl.nn.lora_linear``).

Every random draw of a step is seeded from (seed, step): rollouts, AQN noise, refills. So
a run resumed from a checkpoint (TRL/transformers restore the optimizer, scheduler, data
order and RNG states) continues as the uninterrupted run would have.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from qerl.config import ConfigError, TrainConfig
from qerl.cpu_threads import CPUThreads
from qerl.nn.liger import require_liger, use_liger
from qerl.nn.padded_attention import use_padded_attention
from qerl.rl.checkpoints import save_staged
from qerl.rl.host_optimizer import host_adamw_cls_and_kwargs
from qerl.rl.phases import PHASES
from qerl.rl.rewards import REWARDS, checked
from qerl.rollout import Engine, SamplingParams


def overlong_reward(max_len: int, buffer: int, penalty: float):
    """DAPO's soft overlong punishment of a completion of L tokens: 0 while
    L <= max_len - buffer, then falling linearly to -penalty at L = max_len."""

    def overlong_reward(completions, completion_ids, **_) -> list[float]:
        start = max_len - buffer
        return [-penalty * min(1.0, max(0, len(ids) - start) / buffer) for ids in completion_ids]

    return overlong_reward


def tis_enabled(config: TrainConfig) -> bool:
    """Whether the loss corrects for the sampler's log-probs (rl.tis; by default only where
    they are not the policy's own forward: another engine, vLLM, samples, or the embedded
    one reads an fp8 KV cache)."""
    if config.rl.tis is not None:
        return config.rl.tis
    return config.engine.backend == "vllm" or config.engine.kv_cache == "fp8"


def checkpointing_kwargs(config: TrainConfig, use_cpu: bool) -> dict | None:
    """The Trainer's gradient_checkpointing_kwargs: transformers' ``offload`` of the layer
    inputs for offload.activations on a GPU. On a CPU they are in host memory already (and
    transformers' offload asks for pinned memory, which a CPU-only torch has none of)."""
    return {"offload": True} if config.offload.activations and not use_cpu else None


def grpo_args(config: TrainConfig, use_cpu: bool) -> GRPOConfig:
    rl, train = config.rl, config.train
    return GRPOConfig(
        output_dir=str(config.output_dir), seed=config.seed, data_seed=config.seed,
        max_steps=train.max_steps, per_device_train_batch_size=train.batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        learning_rate=train.learning_rate, optim=train.optimizer,
        weight_decay=train.weight_decay, adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2, warmup_steps=train.warmup_ratio,
        lr_scheduler_type=train.lr_scheduler, max_grad_norm=train.max_grad_norm,
        gradient_checkpointing=train.gradient_checkpointing,
        gradient_checkpointing_kwargs=checkpointing_kwargs(config, use_cpu),
        save_strategy="steps", save_steps=train.save_steps,
        save_total_limit=train.save_total_limit, logging_steps=train.logging_steps,
        report_to=list(train.report_to), use_cpu=use_cpu, bf16=not use_cpu,
        # The frozen base's buffers (NVFP4 codes and fp8 scales) are identical on every
        # process; DDP's broadcast of them is wasted, and gloo cannot send fp8.
        ddp_broadcast_buffers=False,
        loss_type=rl.loss_type, beta=rl.beta, epsilon=rl.epsilon,
        epsilon_high=rl.epsilon_high, num_iterations=rl.num_iterations,
        num_generations=rl.num_generations,
        mask_truncated_completions=rl.mask_truncated_completions,
        temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k or None,
        max_completion_length=rl.max_completion_length,
        reward_weights=[*rl.rewards.values(), *([1.0] if rl.overlong.enabled else [])],
        vllm_importance_sampling_correction=tis_enabled(config),
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=rl.tis_cap,
    )


class _RestoreNoise(TrainerCallback):
    """AQN's noise comes off before the optimizer updates the weights."""

    def __init__(self, trainer: QerlGRPOTrainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer.policy.aqn is not None:
            self.trainer.policy.aqn.restore()


class _PhaseTimes(TrainerCallback):
    """Where an optimizer step's time goes, logged once per step: rollout (the engine),
    scoring (rewards and the log-probs TRL computes before the loss), train (forward and
    backward of every micro-batch) and optimizer; and the step's peak GPU memory, allocated
    and as torch's allocator reserved it."""

    def __init__(self, trainer: QerlGRPOTrainer):
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer._phases = dict.fromkeys(PHASES, 0.0)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.start = self.trainer._now()

    def on_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        phases = {**trainer._phases, "optimizer": trainer._now() - self.start}
        metrics = trainer._metrics["train"]
        for phase, seconds in phases.items():
            metrics[f"time/{phase}_s"].append(seconds)
        if torch.cuda.is_available():
            metrics["memory/peak_gb"].append(torch.cuda.max_memory_allocated() / 1e9)
            metrics["memory/reserved_peak_gb"].append(torch.cuda.max_memory_reserved() / 1e9)


def _align_special_tokens(model, tokenizer) -> None:
    """The model's PAD/BOS/EOS ids aligned with the tokenizer's, as transformers' Trainer
    aligns them (its own function), but without its notice at every run: the tokenizer is
    the model's own or the one the configuration names, so no setting could answer it."""
    from transformers.trainer_utils import align_special_tokens
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        align_special_tokens(model, tokenizer)
    finally:
        logging.set_verbosity(level)


def _keep_checkpoint_offload(model) -> None:
    """Gradient checkpointing turned on again keeps transformers' ``offload`` of the layer
    inputs (offload.activations). TRL turns it off around its no-grad forward and on again
    with ``gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)``, which hands
    the Trainer's own ``offload`` key to torch's checkpoint (a TypeError) where the Trainer
    pops it: the key goes back where transformers takes it."""
    enable = model.gradient_checkpointing_enable

    def gradient_checkpointing_enable(gradient_checkpointing_kwargs=None, **kwargs):
        kwargs_ = dict(gradient_checkpointing_kwargs or {})
        kwargs["offload"] = kwargs_.pop("offload", kwargs.get("offload", True))
        return enable(gradient_checkpointing_kwargs=kwargs_ or None, **kwargs)

    model.gradient_checkpointing_enable = gradient_checkpointing_enable


class QerlGRPOTrainer(GRPOTrainer):
    def __init__(self, policy, config: TrainConfig, tokenizer, train_dataset,
                 callbacks: list | None = None):
        self.policy, self.qerl_config = policy, config
        rl = config.rl
        rewards = [checked(REWARDS[name]) for name in rl.rewards]
        if rl.overlong.enabled:
            rewards.append(checked(overlong_reward(rl.max_completion_length,
                                                   rl.overlong.buffer, rl.overlong.penalty)))
        device = next(policy.model.parameters()).device
        _align_special_tokens(policy.model, tokenizer)
        super().__init__(model=policy.model, reward_funcs=rewards,
                         args=grpo_args(config, use_cpu=device.type != "cuda"),
                         train_dataset=train_dataset, processing_class=tokenizer,
                         callbacks=[*(callbacks or [])])
        if config.offload.optimizer:  # transformers' create_optimizer builds it
            self.optimizer_cls_and_kwargs = host_adamw_cls_and_kwargs(self.args)
        if (self.args.gradient_checkpointing_kwargs or {}).get("offload"):
            _keep_checkpoint_offload(self.model)
        if rl.dynamic_sampling and self.accelerator.num_processes > 1:
            raise ConfigError("rl.dynamic_sampling runs on one process for now (refills "
                              "would have to agree across processes); turn it off for "
                              "multi-GPU runs")
        # TRL corrects for the sampler (a no-grad forward for the pre-update log-probs, the
        # truncated ratio in the loss, its sampling/* metrics) only under use_vllm, which
        # otherwise routes generation: _generate_single_turn below replaces that routing.
        self.use_vllm = self.args.vllm_importance_sampling_correction
        self._mismatch_of: dict | None = None  # a loss's inputs, until its forward is seen
        use_padded_attention(policy.base_model)
        if device.type == "cuda" and config.train.liger:
            require_liger()
            use_liger(policy.base_model)
        self.add_callback(_RestoreNoise(self))
        self.add_callback(_PhaseTimes(self))
        self._threads = CPUThreads() if device.type == "cpu" else None
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._engine: Engine | None = None
        self._rollout_calls = (-1, 0)  # (step, rollouts sampled in it)

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._threads is not None:
                self._threads.restore()

    def _on_idle_cores(self) -> None:
        """On a CPU: what follows (a rollout, a training forward and backward) runs on as
        many threads as other processes left cores idle since the last such call
        (qerl.cpu_threads; other jobs come and go within a step), logged as
        ``cpu/threads``."""
        if self._threads is not None:
            self._metrics["train"]["cpu/threads"].append(self._threads.adjust())

    # Rollouts ---------------------------------------------------------------------

    def _save_checkpoint(self, model, trial):
        # Saved aside and renamed into place with its manifest: a checkpoint-N in
        # output_dir is whole (qerl.rl.checkpoints).
        save_staged(self, trial, lambda: super(QerlGRPOTrainer, self)._save_checkpoint(model,
                                                                                      trial))

    def _engine_for(self, batch: int) -> Engine:
        """An engine for ``batch`` sequences, or for as many as engine.max_batch names or
        engine.kv_budget_gb holds (the rollout then runs in chunks of that size)."""
        rl = self.qerl_config.rl
        seq_len = rl.max_prompt_length + rl.max_completion_length
        batch = min(batch, self.qerl_config.engine.max_batch or batch)
        budget = self.qerl_config.engine.kv_budget_gb
        if budget is not None:
            dtype = self.policy.base_model.get_input_embeddings().weight.dtype
            fits = Engine.max_batch_for(self.policy.config, int(budget * 1e9), seq_len, dtype,
                                        self.qerl_config.engine.kv_cache)
            if fits < 1:
                raise ConfigError(f"engine.kv_budget_gb={budget} holds no sequence of "
                                  f"{seq_len} tokens")
            batch = min(batch, fits)
        if self._engine is None or batch > self._engine.max_batch:
            if self.qerl_config.engine.backend == "vllm":
                from qerl.rollout.vllm_backend import VLLMEngine

                self._engine = VLLMEngine(self.policy, self.qerl_config.output_dir / "vllm",
                                          max_batch=batch, max_seq_len=seq_len)
            else:
                self._engine = Engine(self.policy, max_batch=batch, max_seq_len=seq_len,
                                      kv_cache=self.qerl_config.engine.kv_cache)
        return self._engine

    def _rollout_seed(self) -> int:
        """A seed from (seed, step, process, n-th rollout of the step): never from a
        counter a resumed run would not have."""
        step = self.state.global_step
        calls = self._rollout_calls[1] + 1 if self._rollout_calls[0] == step else 0
        self._rollout_calls = (step, calls)
        rank = self.accelerator.process_index
        return (((self.qerl_config.seed * 1_000_003 + step) * 1_009 + rank) * 101
                + calls) % (1 << 62)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                              has_tool_images=False):
        rl = self.qerl_config.rl
        longest = max(map(len, prompt_ids))
        if longest > rl.max_prompt_length:  # run.fitting_prompts filtered the task
            raise RuntimeError(f"a prompt of {longest} tokens reached the rollout; "
                               f"rl.max_prompt_length is {rl.max_prompt_length}")
        params = SamplingParams(max_new_tokens=rl.max_completion_length,
                                temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
                                stop_token_ids=tuple(self.eos_token_ids),
                                seed=self._rollout_seed())
        if self.accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        self._on_idle_cores()
        built = time.perf_counter()
        # Building the engine (vLLM: export, load, graphs; a first step's cost) is rollout
        # time, not scoring's; the tokens/s below are the generation's alone.
        engine = self._engine_for(len(prompt_ids))
        if self.accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        self._phases["rollout"] += start - built
        tokens, logprobs = [], []
        for first in range(0, len(prompt_ids), engine.max_batch):
            chunk = prompt_ids[first:first + engine.max_batch]
            # Each chunk its own seed: a chunk is a rollout call of its own.
            out = engine.generate(chunk, replace(params, seed=self._rollout_seed())
                                  if first else params)
            tokens += out.tokens
            logprobs += out.logprobs
        if self.qerl_config.engine.release_cache:
            engine.release()
        seconds = time.perf_counter() - start
        self._phases["rollout"] += seconds
        self._metrics["train"]["rollout/tokens_per_s"].append(
            sum(map(len, tokens)) / max(seconds, 1e-9))
        return tokens, logprobs

    # Sampler/trainer mismatch --------------------------------------------------------

    def _compute_loss(self, model, inputs):
        """TRL's loss, and the mismatch between the log-probs the rollout sampled with and
        the training forward's: the pre-update forward's where TRL ran one, else (its
        log-probs equal then) the loss's own."""
        self._on_idle_cores()
        sampled = inputs.get("sampling_per_token_logps")
        if sampled is not None and inputs.get("old_per_token_logps") is not None:
            self._log_mismatch(inputs["old_per_token_logps"], sampled, inputs["completion_mask"])
        elif sampled is not None:
            self._mismatch_of = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._mismatch_of = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._mismatch_of is not None:
            inputs, self._mismatch_of = self._mismatch_of, None
            self._log_mismatch(out[0].detach(), inputs["sampling_per_token_logps"],
                               inputs["completion_mask"])
        return out

    def _log_mismatch(self, trained: torch.Tensor, sampled: torch.Tensor,
                      mask: torch.Tensor) -> None:
        """Per micro-batch over its completion tokens: mean and max |log p_train -
        log p_sampler|, and NeMo-RL's token_mult_prob_error, the mean of exp(|...|) (1 when
        they agree). A logged value is the mean over the step's micro-batches."""
        delta = (trained - sampled).abs()[mask.bool() & ~sampled.isnan()]
        # Every process gathers, also one whose micro-batch has no token to measure.
        values = (torch.stack([delta.mean(), delta.max(), delta.exp().mean()]) if delta.numel()
                  else torch.full((3,), float("nan"), device=delta.device))
        gathered = self.accelerator.gather(values[None]).view(-1, 3)
        measured = gathered[~gathered[:, 0].isnan()]
        if not len(measured):
            return
        metrics = self._metrics["train"]
        metrics["mismatch/logp_diff_mean"].append(measured[:, 0].mean().item())
        metrics["mismatch/logp_diff_max"].append(measured[:, 1].max().item())
        metrics["mismatch/token_mult_prob_error"].append(measured[:, 2].mean().item())

    def _now(self) -> float:
        """A timestamp after the GPU's queued work (so phases are not blurred)."""
        if self.accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    # AQN ----------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        aqn = self.policy.aqn
        if aqn is not None and not aqn.settings.rollout_only and not aqn.perturbed:
            aqn.perturb(self.state.global_step)
        if aqn is not None:
            self._metrics["train"]["aqn/sigma"].append(
                aqn.settings.sigma(aqn.settings.stage(self.state.global_step,
                                                      aqn.total_steps)))
        start, scoring = self._now(), self._phases["score"] + self._phases["rollout"]
        loss = super().training_step(model, inputs, num_items_in_batch)
        # Generation and scoring, when this micro-batch triggered them, ran inside.
        spent = self._phases["score"] + self._phases["rollout"] - scoring
        self._phases["train"] += self._now() - start - spent
        return loss

    def _score(self, inputs):
        """TRL's generate-and-score of ``inputs`` (with AQN's noise around it alone, in
        rollout_only mode), timed: what is not rollout is scoring."""
        start, rollout = self._now(), self._phases["rollout"]
        aqn = self.policy.aqn
        try:
            if aqn is not None and aqn.settings.rollout_only:
                aqn.perturb(self.state.global_step)
                try:
                    return super()._generate_and_score_completions(inputs)
                finally:
                    aqn.restore()
            return super()._generate_and_score_completions(inputs)
        finally:
            self._phases["score"] += (self._now() - start
                                      - (self._phases["rollout"] - rollout))

    # DAPO dynamic sampling ------------------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        batch = self._score(inputs)
        if not self.qerl_config.rl.dynamic_sampling:
            return batch
        size = self.num_generations
        wanted = len(inputs) // size
        parts = [_groups(batch, informative(batch["advantages"], size), size)]
        spare = _groups(batch, ~informative(batch["advantages"], size), size)
        have, refills = _count(parts[0], size), 0
        while have < wanted and refills < self.qerl_config.rl.max_refills:
            refills += 1
            more = self._score(self._fresh_prompts(wanted - have, refills))
            parts.append(_groups(more, informative(more["advantages"], size), size))
            have += _count(parts[-1], size)
        self._metrics["train"]["dynamic_sampling/refills"].append(refills)
        self._metrics["train"]["dynamic_sampling/informative_frac"].append(
            min(have, wanted) / wanted)
        if have < wanted:  # out of refills: groups without signal fill up (no gradient)
            parts.append(spare)
        return _concat(parts, wanted * size)

    def _fresh_prompts(self, groups: int, refill: int) -> list[dict]:
        """``groups`` dataset rows, each repeated num_generations times, drawn with a seed
        of (seed, step, refill) so that a resumed run draws the same."""
        gen = torch.Generator().manual_seed(
            (self.qerl_config.seed * 1_000_003 + self.state.global_step) * 31 + refill)
        rows = torch.randint(len(self.train_dataset), (groups,), generator=gen).tolist()
        return [self.train_dataset[i] for i in rows for _ in range(self.num_generations)]


def informative(advantages: torch.Tensor, size: int) -> torch.Tensor:
    """Per group of ``size`` completions: whether any advantage is non-zero (rewards
    that all agree give every completion advantage 0, hence no gradient)."""
    return advantages.view(-1, size).abs().sum(1) > 0


def _count(batch: dict, size: int) -> int:
    return batch["advantages"].shape[0] // size


def _groups(batch: dict, keep: torch.Tensor, size: int) -> dict:
    rows = keep.repeat_interleave(size)
    return {k: v[rows] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == len(rows)
            else v for k, v in batch.items()}


# Per-row tensors of a scored batch: prompts are left-padded, completions right-padded.
LEFT_PADDED = ("prompt_ids", "prompt_mask")


def _concat(parts: list[dict], rows: int) -> dict:
    """The first ``rows`` rows of the scored batches ``parts``, padded to common widths;
    num_items_in_batch recounted."""
    keys = [k for k, v in parts[0].items() if isinstance(v, torch.Tensor) and v.dim()]
    out = dict(parts[0])
    for key in keys:
        tensors = [p[key] for p in parts if p[key].shape[0]]
        if tensors[0].dim() == 2:
            width = max(t.shape[1] for t in tensors)
            left = key in LEFT_PADDED
            tensors = [torch.nn.functional.pad(t, (width - t.shape[1], 0) if left
                                               else (0, width - t.shape[1]))
                       for t in tensors]
        out[key] = torch.cat(tensors)[:rows]
    out["num_items_in_batch"] = out["completion_mask"].sum()
    return out
