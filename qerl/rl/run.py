"""``qerl train --config FILE.yaml``: build the policy, the task and the trainer from a
checked configuration, resume from the newest complete checkpoint in ``output_dir`` if
there is one, train, and save the result.

    output_dir/
      checkpoint-N/      transformers/TRL checkpoints (adapter, optimizer, scheduler, RNG) and
                         a manifest of their sizes and hashes, saved in .staging/ and renamed
                         into place (qerl.rl.checkpoints: a checkpoint whose files do not
                         match it is not resumed from)
      damaged/           checkpoints set aside because their files were damaged
      metrics.csv        one row per logged step: TRL's metrics and ours (the report reads it)
      memory_plan.json   with memory_gb: how the step was fitted to it (qerl.rl.budget)
      tokenizer/         the tokenizer the run used
      final/             the trained adapter (LoRA methods) or model (full)
      config.yaml        the configuration as checked
      provenance.json    card, library versions, number of processes
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from pathlib import Path

import torch
import yaml
from transformers import TrainerCallback, set_seed

from qerl.atomic import claim, make_directory
from qerl.config import ConfigError, TrainConfig
from qerl.policy import build_policy
from qerl.record import provenance, version
from qerl.rl.budget import Plan, enforce, fit
from qerl.rl.checkpoints import last_checkpoint
from qerl.rl.data import load_task
from qerl.rl.preemption import Preemption
from qerl.tokenizer import policy_tokenizer

METRICS = "metrics.csv"
MEMORY_PLAN = "memory_plan.json"


class MetricsCSV(TrainerCallback):
    """Every log row to ``metrics.csv``; on resume, rows past the checkpoint's step (logged
    before an interruption, about to be redone) are dropped."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        import pandas as pd

        if self.path.is_file() and state.global_step > 0:
            old = pd.read_csv(self.path)
            self.rows = old[old.step <= state.global_step].to_dict("records")
        else:
            self.rows = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        import pandas as pd

        if not logs or "train_runtime" in logs or not state.is_world_process_zero:
            return
        self.rows.append({"step": state.global_step, **logs})
        tmp = self.path.with_suffix(".tmp")
        pd.DataFrame(self.rows).to_csv(tmp, index=False)
        tmp.replace(self.path)


def _device(config: TrainConfig) -> str:
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for, but no CUDA GPU is available")
    return config.device


def _process_device(device: str) -> str:
    """This process's device: under a multi-GPU launch, its own GPU."""
    import os

    if device == "cuda" and "LOCAL_RANK" in os.environ:
        return f"cuda:{int(os.environ['LOCAL_RANK'])}"
    return device


def fitting_prompts(task, tokenizer, max_tokens: int):
    """The rows of ``task`` whose prompt, rendered by the chat template, fits
    ``max_tokens`` (DAPO drops the others rather than cutting a question short)."""
    texts = tokenizer.apply_chat_template(list(task["prompt"]), tokenize=False,
                                          add_generation_prompt=True)
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    keep = [i for i, n in enumerate(lengths) if n <= max_tokens]
    if not keep:
        raise ConfigError(f"no prompt of the task fits rl.max_prompt_length={max_tokens} "
                          f"tokens (the shortest has {min(lengths)})")
    if len(keep) < len(task):
        print(f"qerl train: {len(task) - len(keep)} of {len(task)} prompts are longer than "
              f"rl.max_prompt_length={max_tokens} tokens and are left out")
    return task.select(keep)


def _within_budget(config: TrainConfig, device: str) -> tuple[TrainConfig, Plan]:
    """``config`` planned into its memory_gb (qerl.rl.budget), the plan logged, and on a GPU
    enforced."""
    from qerl.policy import base_config

    planned, plan = fit(config, base_config(config.model, arch=config.arch))
    print(f"qerl train: {plan.describe()}")
    if device == "cuda":
        print(f"qerl train: {enforce(plan, torch.device(_process_device(device)))}")
    else:
        print("qerl train: the memory budget is planned, not enforced: a CPU run applies the "
              "plan's settings, but nothing caps the host's memory")
    return planned, plan


def build_trainer(config: TrainConfig, callbacks: list | None = None):
    """The policy, tokenizer, task and trainer of ``config`` (nothing trained yet)."""
    from qerl.rl.trainer import QerlGRPOTrainer

    set_seed(config.seed)
    aqn_on = config.aqn.enabled if config.aqn.enabled is not None else config.method == "qerl"
    device = _device(config)
    plan = None
    if config.memory_gb is not None:  # before the rest: a step that cannot fit builds nothing
        config, plan = _within_budget(config, device)
    data = config.data
    task = load_task(data.task, path=data.path, split=data.split, limit=data.limit,
                     level=data.level, size=data.size, seed=config.seed)
    policy = build_policy(config.method, config.model, arch=config.arch, seed=config.seed,
                          lora=config.lora, aqn=config.aqn if aqn_on else None,
                          total_steps=config.train.max_steps, device=_process_device(device),
                          embedding_on_host=config.offload.embedding)
    make_directory(config.output_dir)
    if plan is not None and _main_rank():
        (config.output_dir / MEMORY_PLAN).write_text(json.dumps(plan.as_dict(), indent=2))
    tokenizer = policy_tokenizer(policy, config.output_dir / "tokenizer", config.tokenizer,
                                 cpu=device == "cpu")
    task = fitting_prompts(task, tokenizer, config.rl.max_prompt_length)
    return QerlGRPOTrainer(policy, config, tokenizer, task,
                           callbacks=[MetricsCSV(config.output_dir / METRICS),
                                      *(callbacks or [])])


# Settings that may change between a run and its resumption: they change nothing learned.
RESUMABLE = {"device", "train.report_to", "train.logging_steps", "train.save_steps",
             "train.save_total_limit", "engine.release_cache", "offload.embedding",
             "offload.activations"}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_same_run(config: TrainConfig) -> None:
    """A run resumes only with the settings it started with (config.yaml beside it). A
    setting its config.yaml lacks (one added to qerl since) counts as unchanged while it
    keeps its default."""
    saved = config.output_dir / "config.yaml"
    if last_checkpoint(config.output_dir, _main_rank()) is None or not saved.is_file():
        return
    before = _flat(yaml.safe_load(saved.read_text()))
    now = _flat(config.model_dump(mode="json"))
    defaults = _flat(TrainConfig.model_construct().model_dump(mode="json"))
    before = {**{k: v for k, v in defaults.items() if k in now}, **before}
    changed = sorted(k for k in before.keys() | now.keys()
                     if before.get(k) != now.get(k) and k not in RESUMABLE)
    if changed:
        raise ConfigError(
            f"{config.output_dir} holds a run started with other settings "
            f"({', '.join(f'{k}: {before.get(k)!r} -> {now.get(k)!r}' for k in changed)}); "
            "resume it with its own settings, or give a new output_dir")


def _step(checkpoint: Path) -> int:
    return json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]


def train(config: TrainConfig, callbacks: list | None = None):
    """Train (resuming if ``output_dir`` holds a checkpoint); return the trainer. A run
    whose last checkpoint is its last step is not trained again (transformers would take
    one more step): its final weights are written from that checkpoint."""
    # One writer per output_dir: the main process holds it for the run (a rerun after a
    # crash takes it over and resumes); the other processes of a launch write nothing there.
    with claim(config.output_dir, "qerl train") if _main_rank() else nullcontext():
        return _train(config, callbacks)


def _main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _train(config: TrainConfig, callbacks: list | None):
    from transformers import TrainerState

    check_same_run(config)
    preemption = Preemption()
    trainer = build_trainer(config, [preemption, *(callbacks or [])])
    main = trainer.is_world_process_zero()
    if main:
        (config.output_dir / "config.yaml").write_text(
            yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        device = str(next(trainer.policy.model.parameters()).device)
        (config.output_dir / "provenance.json").write_text(json.dumps(
            {**provenance(device), "trl": version("trl"), "peft": version("peft"),
             "processes": trainer.accelerator.num_processes}, indent=2))
    resume = last_checkpoint(config.output_dir, _main_rank())
    if resume is not None and _step(resume) >= config.train.max_steps:
        trainer._load_from_checkpoint(str(resume))
        trainer.state = TrainerState.load_from_json(str(resume / "trainer_state.json"))
    else:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    preemption.check(config.output_dir, trainer.state.global_step)
    if main:
        final = config.output_dir / "final"
        if trainer.policy.lora is not None:
            trainer.policy.save_adapter(final)
        else:
            trainer.policy.model.save_pretrained(final)
    return trainer
