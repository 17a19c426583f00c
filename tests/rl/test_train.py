"""`qerl train` on a tiny random model, on CPU: every method runs its steps, an
interrupted run resumed by rerunning the same command logs what the uninterrupted run
logs, and bad configurations are refused before any work."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time

import pandas as pd
import pytest
import torch
import yaml
from transformers import TrainerCallback

from qerl.cli import main as cli
from qerl.config import ConfigError, load_config, parse_config
from qerl.rl.checkpoints import last_checkpoint
from qerl.rl.run import METRICS, train
from qerl.rl.trainer import overlong_reward
from qerl.tokenizer import TokenizerError
from tests.conftest import CHAT, require, save_tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("reference_kernels")

# Metrics that depend on the clock or the machine's load, not on the run's numbers.
TIMING = ("step_time", "rollout/tokens_per_s", "train_runtime", "time/rollout_s",
          "time/score_s", "time/train_s", "time/optimizer_s", "cpu/threads")


def settings(model, out, method="qerl", **train) -> dict:
    return {
        "model": str(model), "method": method, "output_dir": str(out), "seed": 3,
        "lora": {"rank": 4, "alpha": 8},
        "data": {"task": "arithmetic", "level": 1, "size": 32},
        "rl": {"num_generations": 2, "max_prompt_length": 48, "max_completion_length": 6,
               "overlong": {"enabled": True, "buffer": 3}},
        "train": {"max_steps": 2, "batch_size": 4, "learning_rate": 1e-3, "save_steps": 2,
                  "report_to": [], **train},
    }


def run(raw: dict, callbacks=None):
    return train(parse_config(raw), callbacks)


@pytest.mark.parametrize("method", ["qerl", "lora", "qlora", "full"])
def test_each_method_trains(chat_model, tmp_path, method):
    if method == "qlora":
        require("bitsandbytes")
    threads = torch.get_num_threads()  # set for each phase on a CPU, and given back
    trainer = run(settings(chat_model, tmp_path, method))
    metrics = pd.read_csv(tmp_path / METRICS)
    assert list(metrics.step) == [1, 2]
    for column in ("loss", "reward", "entropy", "rollout/tokens_per_s",
                   "rewards/overlong_reward/mean", "rewards/accuracy_reward/mean",
                   "time/rollout_s", "time/score_s", "time/train_s", "time/optimizer_s",
                   "cpu/threads"):
        assert metrics[column].notna().all(), column
    assert (metrics["cpu/threads"] >= 1).all() and torch.get_num_threads() == threads
    assert ("aqn/sigma" in metrics) == (method == "qerl")
    # Its padded batches attend without a mask (qerl.nn.padded_attention).
    assert trainer.policy.base_model.config._attn_implementation == "qerl_sdpa"
    assert trainer.state.global_step == 2
    final = tmp_path / "final"
    assert (final / ("model.safetensors" if method == "full" else "adapter_config.json")).is_file()
    assert last_checkpoint(tmp_path).name == "checkpoint-2"
    assert {"card", "torch", "trl", "processes"} <= set(
        json.loads((tmp_path / "provenance.json").read_text()))


class Snapshot(TrainerCallback):
    """Every tensor of the model (parameters and buffers) as training begins."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.before = {name: t.detach().clone() for name, t in model.state_dict().items()}
        self.trainable = {name for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", ["qerl", "lora"])
def test_training_moves_every_adapter_weight_and_leaves_the_base_bit_identical(
        chat_model, tmp_path, monkeypatch, method):
    """As TRL's own trainer tests check: after two steps every trainable (LoRA) weight
    has changed, and every other tensor (the NVFP4 codes and scales, the BF16 base, the
    norms AQN perturbed during each step, the embeddings) is bit-identical. A reward that
    splits every group gives each step a gradient."""
    from qerl.rl import trainer as trainer_module

    monkeypatch.setitem(trainer_module.REWARDS, "format",
                        lambda completions, **_: [float(i % 2) for i in range(len(completions))])
    raw = settings(chat_model, tmp_path, method)
    raw["rl"]["mask_truncated_completions"] = False  # a tiny model's completions all are
    snapshot = Snapshot()
    trainer = run(raw, [snapshot])
    assert pd.read_csv(tmp_path / METRICS).grad_norm.gt(0).all()  # (the on-policy loss is 0)
    after = trainer.model.state_dict()
    assert after.keys() == snapshot.before.keys()
    assert snapshot.trainable and all("lora_" in name for name in snapshot.trainable)
    moved = {name for name, t in snapshot.before.items() if not torch.equal(t, after[name])}
    assert moved == snapshot.trainable, sorted(moved ^ snapshot.trainable)[:5]


class Interrupt(TrainerCallback):
    """Dies in the middle of a step, after the checkpoint before it was written."""

    def __init__(self, at_step: int):
        self.at_step = at_step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.at_step:
            raise KeyboardInterrupt


def test_an_interrupted_run_resumes_exactly(chat_model, tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    run(settings(chat_model, whole, max_steps=4))
    with pytest.raises(KeyboardInterrupt):
        run(settings(chat_model, broken, max_steps=4), [Interrupt(at_step=3)])
    assert last_checkpoint(broken).name == "checkpoint-2"
    run(settings(chat_model, broken, max_steps=4))  # the same command again
    a, b = (pd.read_csv(d / METRICS).drop(columns=list(TIMING), errors="ignore")
            for d in (whole, broken))
    assert list(b.step) == [1, 2, 3, 4]
    pd.testing.assert_frame_equal(a, b)


def test_a_finished_run_is_not_trained_again(chat_model, tmp_path):
    """Rerunning a finished run (as a workflow does when its final/ is gone) writes the same
    final adapter from the last checkpoint, logs no step past max_steps, and a changed
    setting is refused instead of resumed."""
    from safetensors.torch import load_file

    run(settings(chat_model, tmp_path))
    adapter = tmp_path / "final" / "adapter_model.safetensors"
    first = load_file(adapter)
    shutil.rmtree(tmp_path / "final")
    trainer = run(settings(chat_model, tmp_path))
    assert trainer.state.global_step == 2
    assert list(pd.read_csv(tmp_path / METRICS).step) == [1, 2]
    again = load_file(adapter)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    with pytest.raises(ConfigError, match=r"other settings \(train.learning_rate: 0.001 -> 0.002"):
        run(settings(chat_model, tmp_path, learning_rate=2e-3))
    # A run saved before a setting existed resumes while that setting keeps its default.
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del saved["lora"]["target_modules"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert run(settings(chat_model, tmp_path)).state.global_step == 2


def test_a_micro_batch_may_hold_part_of_a_group(chat_model, tmp_path):
    """One completion per forward/backward, a group of two per step (what a large model
    needs to fit): the rollout still samples whole groups."""
    trainer = run(settings(chat_model, tmp_path, batch_size=1, gradient_accumulation_steps=2))
    assert trainer.state.global_step == 2
    assert pd.read_csv(tmp_path / METRICS)["reward"].notna().all()


def test_the_cli_trains_from_a_yaml_file(chat_model, tmp_path):
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(settings(chat_model, tmp_path / "out", "lora")))
    assert cli(["train", "--config", str(path), "--set", "train.max_steps=1",
                "--set", "train.save_steps=1", "--set", "train.report_to=[tensorboard]"]) == 0
    assert list(pd.read_csv(tmp_path / "out" / METRICS).step) == [1]
    assert list((tmp_path / "out").rglob("events.out.tfevents.*"))  # TensorBoard
    assert cli(["train", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_a_model_whose_special_tokens_differ_from_its_tokenizers_trains_quietly(
        chat_model, tmp_path):
    """transformers' Trainer aligns the model's PAD/BOS/EOS ids with the tokenizer's and
    says so at every run, a notice no setting could answer: aligned before it, quietly, to
    the same ids."""
    model = tmp_path / "model"
    shutil.copytree(chat_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": 100,
                                                   "bos_token_id": 101, "pad_token_id": 102}))
    said = []  # transformers' own logger, which does not propagate to the root's
    listener = logging.Handler()
    listener.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(listener)
    try:
        trainer = run(settings(model, tmp_path / "out", "lora", max_steps=1))
    finally:
        logging.getLogger("transformers").removeHandler(listener)
    assert not [line for line in said if "PAD/BOS/EOS" in line]
    tokenizer = trainer.processing_class
    assert trainer.model.config.pad_token_id == tokenizer.pad_token_id
    assert tokenizer.eos_token_id in trainer.model.generation_config.eos_token_id


def test_bad_configs_name_the_key(chat_model, tmp_path):
    good = settings(chat_model, tmp_path)
    cases = [
        ({**good, "lr": 1e-5}, "lr: Extra inputs are not permitted"),
        ({**good, "rl": {**good["rl"], "num_generations": "many"}}, "rl.num_generations"),
        ({**good, "train": {**good["train"], "batch_size": 5}}, "multiple of rl.num_generations"),
        ({**good, "method": "qat"}, "method"),
        ({**good, "arch": "qwen2.5-7b"}, "exactly one of model and arch"),
    ]
    for raw, message in cases:
        with pytest.raises(ConfigError, match=message):
            parse_config(raw)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(TokenizerError, match="has no chat template"):
        run({**good, "tokenizer": None, "model": str(save_model_without_chat(tmp_path))})


def save_model_without_chat(tmp_path):
    path = tmp_path / "plain"
    save_tiny_model(path, hard_values=False)
    return path


def test_overlong_reward_ramps_to_the_penalty():
    reward = overlong_reward(max_len=10, buffer=4, penalty=1.0)
    assert reward(None, [[0] * n for n in (3, 6, 8, 10)]) == [0.0, 0.0, -0.5, -1.0]


def test_dynamic_sampling_replaces_groups_without_signal(chat_model, tmp_path, monkeypatch):
    """A reward that splits some groups and not others: the trained batches hold only
    groups whose rewards differ, refilled from fresh prompts."""
    import zlib

    from qerl.rl import trainer as trainer_module

    def coin(completions, **_):
        return [float(zlib.crc32(str(c).encode()) % 3 == 0) for c in completions]

    monkeypatch.setitem(trainer_module.REWARDS, "format", coin)
    seen = []
    real = trainer_module.QerlGRPOTrainer._generate_and_score_completions

    def spy(self, inputs):
        batch = real(self, inputs)
        seen.append(trainer_module.informative(batch["advantages"], self.num_generations))
        return batch

    monkeypatch.setattr(trainer_module.QerlGRPOTrainer, "_generate_and_score_completions", spy)
    raw = settings(chat_model, tmp_path, "lora", max_steps=3)
    raw["rl"] = {**raw["rl"], "dynamic_sampling": True, "max_refills": 8,
                 "rewards": {"format": 1.0}, "overlong": {"enabled": False}}
    run(raw)
    metrics = pd.read_csv(tmp_path / METRICS)
    assert (metrics["dynamic_sampling/informative_frac"] == 1.0).all()
    assert metrics["dynamic_sampling/refills"].sum() > 0  # some batches needed refills
    assert len(seen) == 3 and all(bool(keep.all()) for keep in seen)


def test_concat_pads_prompts_left_and_completions_right():
    import torch

    from qerl.rl.trainer import _concat, _groups, informative

    def batch(width, adv):
        rows = len(adv)
        return {"prompt_ids": torch.ones(rows, width, dtype=torch.long),
                "prompt_mask": torch.ones(rows, width, dtype=torch.long),
                "completion_ids": torch.full((rows, width + 1), 7),
                "completion_mask": torch.ones(rows, width + 1, dtype=torch.long),
                "advantages": torch.tensor(adv), "num_items_in_batch": torch.tensor(0)}

    a, b = batch(2, [0.0, 0.0, 1.0, -1.0]), batch(3, [0.5, -0.5, 0.0, 0.0])
    keep_a, keep_b = informative(a["advantages"], 2), informative(b["advantages"], 2)
    assert keep_a.tolist() == [False, True] and keep_b.tolist() == [True, False]
    out = _concat([_groups(a, keep_a, 2), _groups(b, keep_b, 2)], 4)
    assert out["advantages"].tolist() == [1.0, -1.0, 0.5, -0.5]
    assert out["prompt_mask"].tolist()[0] == [0, 1, 1] and out["prompt_mask"].tolist()[2] == [1] * 3
    assert out["completion_mask"].tolist()[0] == [1, 1, 1, 0]
    assert out["num_items_in_batch"].item() == 3 + 3 + 4 + 4


def test_shipped_configs_are_valid():
    from pathlib import Path

    files = sorted(Path("workflows/config").glob("train_*.yaml"))
    assert files
    for path in files:
        load_config(path)



def test_a_bad_override_is_blamed_on_the_flag_and_the_file_keeps_its_own(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: m\noutput_dir: out\ndata: {task: gsm8k}\ntrain: {max_steps: 0}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(config, {"train": {"max_stepz": 3}, "trian": {"seed": 1}})
    message = str(caught.value)
    assert message.startswith("--set train.max_stepz: Extra inputs")
    assert "trian: Extra inputs" in message.split(f"{config}:")[0]
    assert message.split(f"{config}: ")[1].startswith("train.max_steps: Input should be")

def test_prompts_over_the_limit_are_left_out(chat_model, tmp_path):
    from qerl.rl.data import load_task
    from qerl.rl.run import fitting_prompts

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT
    task = load_task("gsm8k", path="tests/data/gsm8k_train_head200.jsonl")
    lengths = [len(tokenizer.apply_chat_template(p, tokenize=False).split()) for p in
               task["prompt"]]
    limit = sorted(lengths)[len(lengths) // 2]
    kept = fitting_prompts(task, tokenizer, limit + 1)
    assert 0 < len(kept) < len(task)
    with pytest.raises(ConfigError, match="no prompt of the task fits"):
        fitting_prompts(task, tokenizer, 2)


def test_two_processes_train_data_parallel(chat_model, tmp_path):
    """torchrun with two CPU processes (gloo): the path `accelerate launch`/torchrun take
    on several GPUs — DDP over the LoRA parameters, one engine per process."""
    import subprocess
    import sys

    import yaml

    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(settings(chat_model, tmp_path / "out", "qerl")))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "2", "-m", "qerl.cli", "train", "--config", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = pd.read_csv(tmp_path / "out" / METRICS)
    single = run(settings(chat_model, tmp_path / "single", "qerl"))
    assert list(metrics.step) == [1, 2]
    # Each step's tokens are counted over both processes' rollouts (about twice one's:
    # completions may stop early at different lengths).
    first = pd.read_csv(tmp_path / "single" / METRICS).num_tokens[0]
    assert 1.5 * first < metrics.num_tokens[0] <= 2.5 * first
    assert single.state.global_step == 2 and (tmp_path / "out" / "final").is_dir()


def test_sigterm_stops_every_process_after_the_same_step(chat_model, tmp_path):
    """SIGTERM to torchrun (which passes it to both workers, each at its own moment): they
    agree on the step to stop after, save its checkpoint and exit non-zero. (Resuming a
    two-process CPU run fails inside transformers, which maps the checkpoint's tensors to
    "cpu:1"; on GPUs it maps them to each process's device.)"""
    import re
    import subprocess
    import sys
    import time

    import yaml

    path = tmp_path / "ddp.yaml"
    out = tmp_path / "out"
    path.write_text(yaml.safe_dump(settings(chat_model, out, "qerl", max_steps=8,
                                            save_steps=100)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
           "qerl.cli", "train", "--config", str(path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (out / METRICS).exists():  # training runs: the handlers are in place
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    steps = set(re.findall(r"stopped by SIGTERM after step (\d+)", err))
    assert proc.returncode != 0 and len(steps) == 1, err[-3000:]  # every report: one step
    assert last_checkpoint(out).name == f"checkpoint-{steps.pop()}"
    assert not (out / "final").exists()


@pytest.mark.parametrize(("method", "rl"), [
    ("lora", {"loss_type": "grpo", "beta": 0.04}),
    ("full", {"loss_type": "grpo", "beta": 0.04}),
    ("qerl", {"loss_type": "dr_grpo"}),
    ("qerl", {"loss_type": "dapo", "num_iterations": 2, "mask_truncated_completions": False}),
])
def test_trl_loss_variants_run(chat_model, tmp_path, method, rl):
    raw = settings(chat_model, tmp_path, method, max_steps=2)
    raw["rl"] = {**raw["rl"], **rl}
    metrics = pd.read_csv(tmp_path / METRICS) if run(raw) else None
    assert list(metrics.step) == [1, 2] and metrics.loss.notna().all()
    if rl.get("beta"):
        assert "kl" in metrics and metrics.kl.notna().all()


def test_a_kv_budget_splits_the_rollout_into_chunks(chat_model, tmp_path):
    from transformers import AutoConfig

    from qerl.policy import compute_dtype
    from qerl.rollout.decoder import KVCache

    raw = settings(chat_model, tmp_path, "lora")
    rl = parse_config(raw).rl
    seq = rl.max_prompt_length + rl.max_completion_length
    per_sequence = seq * KVCache.bytes_per_slot(AutoConfig.from_pretrained(chat_model),
                                                 compute_dtype("cpu"))  # the model's dtype
    raw["engine"] = {"kv_budget_gb": 2.5 * per_sequence / 1e9}  # holds 2 of the 4
    trainer = run(raw)
    assert trainer._engine.max_batch == 2
    assert list(pd.read_csv(tmp_path / METRICS).step) == [1, 2]
    raw["engine"] = {"kv_budget_gb": 0.5 * per_sequence / 1e9}
    raw["output_dir"] = str(tmp_path / "none")
    with pytest.raises(ConfigError, match="holds no sequence"):
        run(raw)


def test_an_fp8_cache_holds_more_of_a_kv_budget(chat_model, tmp_path):
    """engine.kv_cache fp8: the budget that holds 2 of the 4 sequences in the model's dtype
    (fp32 on this CPU) holds all of them in 8 bits, and the rollouts use that cache."""
    from transformers import AutoConfig

    from qerl.policy import compute_dtype
    from qerl.rollout.decoder import KVCache

    raw = settings(chat_model, tmp_path, "lora")
    rl = parse_config(raw).rl
    seq = rl.max_prompt_length + rl.max_completion_length
    per_sequence = seq * KVCache.bytes_per_slot(AutoConfig.from_pretrained(chat_model),
                                                 compute_dtype("cpu"))
    raw["engine"] = {"kv_budget_gb": 2.5 * per_sequence / 1e9, "kv_cache": "fp8"}
    trainer = run(raw)
    assert trainer._engine.max_batch == 4
    assert trainer._engine.cache.k.dtype == torch.float8_e4m3fn
    assert list(pd.read_csv(tmp_path / METRICS).step) == [1, 2]


def test_the_kv_cache_format_is_bf16_or_fp8(tmp_path):
    raw = {"model": "m", "output_dir": str(tmp_path)}
    assert parse_config(raw).engine.kv_cache == "bf16"
    assert parse_config({**raw, "engine": {"kv_cache": "fp8"}}).engine.kv_cache == "fp8"
    with pytest.raises(ConfigError, match="engine.kv_cache: Input should be 'bf16' or 'fp8'"):
        parse_config({**raw, "engine": {"kv_cache": "int8"}})
    with pytest.raises(ConfigError, match="engine.kv_cache fp8 is the embedded engine's"):
        parse_config({**raw, "engine": {"kv_cache": "fp8", "backend": "vllm"}})


def test_checkpoint_offload_survives_trls_toggling(tmp_path):
    """offload.activations on a GPU: transformers' Trainer turns checkpointing on with its
    ``offload`` key, and TRL's off-and-on-again around a no-grad forward passes the same
    dict back, which the model would hand to torch's checkpoint (a TypeError): the key is
    put back where transformers takes it, each time."""
    from qerl.rl.trainer import _keep_checkpoint_offload, checkpointing_kwargs

    raw = settings("m", tmp_path, gradient_checkpointing=True)
    raw["offload"] = {"activations": True}
    config = parse_config(raw)
    assert checkpointing_kwargs(config, use_cpu=False) == {"offload": True}
    assert checkpointing_kwargs(config, use_cpu=True) is None
    calls = []

    class Model:
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
            calls.append((gradient_checkpointing_kwargs, kwargs))

    model = Model()
    _keep_checkpoint_offload(model)
    model.gradient_checkpointing_enable({"offload": True})  # TRL's, positional
    model.gradient_checkpointing_enable({"offload": True, "use_reentrant": False})
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None, every_n_layers=2)
    assert calls == [(None, {"offload": True}), ({"use_reentrant": False}, {"offload": True}),
                     (None, {"every_n_layers": 2, "offload": True})]
    with pytest.raises(ConfigError, match="set train.gradient_checkpointing true"):
        parse_config({**raw, "train": {**raw["train"], "gradient_checkpointing": False}})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_offloaded_layer_inputs_leave_the_gpu_through_trls_toggling():
    """After TRL's off-and-on around a no-grad forward, a training forward holds less on the
    GPU by about the checkpointed layer inputs, and its gradients are the same bits."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    from trl.models.utils import disable_gradient_checkpointing

    from qerl.rl.trainer import _keep_checkpoint_offload

    layers, batch, tokens, hidden = 8, 2, 4096, 1024
    config = Qwen2Config(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=tokens)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).train()
    ids = torch.randint(0, 128, (batch, tokens), device="cuda")

    def forward_and_backward(offload: bool):
        model.gradient_checkpointing_enable(offload=offload)  # as the Trainer does
        if offload:
            _keep_checkpoint_offload(model)
        trainer_kwargs = {"offload": True} if offload else None  # the Trainer's arguments
        with torch.no_grad(), disable_gradient_checkpointing(model, trainer_kwargs):
            model(ids[:, :8])
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(ids, labels=ids).loss
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        return held, [p.grad.clone() for p in model.parameters()]

    held, grads = forward_and_backward(False)
    held_offloaded, grads_offloaded = forward_and_backward(True)
    inputs = layers * batch * tokens * hidden * 2  # BF16
    assert held - held_offloaded >= 0.75 * inputs, (held, held_offloaded, inputs)
    for a, b in zip(grads, grads_offloaded, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_the_memory_measures_change_nothing_learned(chat_model, tmp_path):
    """The input embedding, AdamW's state and checkpointing's layer inputs in host memory
    and the KV cache freed between rollouts (what a memory budget may take) move memory,
    not numbers: four steps log what the same run without them logs (the host AdamW runs
    the CPU's fused kernel where the Trainer's adamw_torch runs its single-tensor loop,
    which differ by fp32 rounding), and the adapters end the same to that rounding;
    interrupted, the run resumes exactly. (On a CPU the layer inputs are in host memory
    already: test_checkpoint_offload_survives_trls_toggling checks that measure's path.)"""
    from safetensors.torch import load_file

    plain, moved = tmp_path / "plain", tmp_path / "moved"
    run(settings(chat_model, plain, max_steps=4, gradient_checkpointing=True))
    raw = settings(chat_model, moved, max_steps=4, gradient_checkpointing=True)
    raw["offload"] = {"embedding": True, "optimizer": True, "activations": True}
    raw["engine"] = {"release_cache": True}
    trainer = run(raw)
    assert trainer._engine.cache is None
    a, b = (pd.read_csv(d / METRICS).drop(columns=list(TIMING), errors="ignore")
            for d in (plain, moved))
    assert list(b.step) == [1, 2, 3, 4]
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-4, atol=1e-6)
    adapters = [load_file(d / "final" / "adapter_model.safetensors") for d in (plain, moved)]
    assert adapters[0].keys() == adapters[1].keys()
    for name, tensor in adapters[0].items():
        torch.testing.assert_close(adapters[1][name], tensor, rtol=0, atol=1e-6, msg=name)
    broken = {**raw, "output_dir": str(tmp_path / "broken")}
    with pytest.raises(KeyboardInterrupt):
        run(broken, [Interrupt(at_step=3)])
    run(broken)  # from checkpoint-2: the host AdamW's state as it saved it
    pd.testing.assert_frame_equal(
        b, pd.read_csv(tmp_path / "broken" / METRICS).drop(columns=list(TIMING),
                                                           errors="ignore"))


@pytest.mark.usefixtures("fake_vllm")
def test_the_vllm_backend_serves_the_rollouts(chat_model, tmp_path, monkeypatch):
    """engine.backend: vllm routes generation to VLLMEngine (against the stand-in vllm
    module here), which pushes the adapter every rollout; vLLM's start is the first step's
    rollout time, not its scoring's."""
    from tests.fake_vllm import FakeLLM

    start = FakeLLM.__init__

    def slow_start(self, *args, **kwargs):
        time.sleep(1.0)  # vLLM's load and graph capture: minutes at 7B
        start(self, *args, **kwargs)

    monkeypatch.setattr(FakeLLM, "__init__", slow_start)
    raw = settings(chat_model, tmp_path, "qerl", max_steps=2)
    raw["engine"] = {"backend": "vllm"}
    raw["rl"] = {**raw["rl"], "beta": 0.04}  # TRL's "ref" adapter beside ours (the paper's KL)
    trainer = run(raw)
    generates = [c for c in FakeLLM.instances[-1].calls if c[0] == "generate"]
    assert len(generates) == 2 and type(trainer._engine).__name__ == "VLLMEngine"
    assert generates[0][2].lora_int_id != generates[1][2].lora_int_id
    times = pd.read_csv(tmp_path / METRICS)[["time/rollout_s", "time/score_s"]].to_numpy()
    assert times[0, 0] >= 1.0 and times[0, 1] - times[1, 1] < 0.5, times


def test_only_the_newest_checkpoints_are_kept(chat_model, tmp_path):
    run(settings(chat_model, tmp_path, max_steps=3, save_steps=1))  # two by default
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2",
                                                                    "checkpoint-3"]
    one = tmp_path / "one"
    run(settings(chat_model, one, max_steps=3, save_steps=1, save_total_limit=1))
    assert [p.name for p in one.glob("checkpoint-*")] == ["checkpoint-3"]


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes(chat_model, tmp_path):
    """The newest checkpoint's optimizer state cut to half (a crash or a full disk while
    saving): the rerun resumes from the one before, keeps the damaged one aside, and ends
    as the run did before the damage."""
    run(settings(chat_model, tmp_path, save_steps=1))
    before = pd.read_csv(tmp_path / METRICS).drop(columns=list(TIMING), errors="ignore")
    adapter = (tmp_path / "final" / "adapter_model.safetensors").read_bytes()
    optimizer = tmp_path / "checkpoint-2" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    shutil.rmtree(tmp_path / "final")
    run(settings(chat_model, tmp_path, save_steps=1))  # the same command again
    assert (tmp_path / "damaged" / "checkpoint-2" / "optimizer.pt").is_file()
    after = pd.read_csv(tmp_path / METRICS).drop(columns=list(TIMING), errors="ignore")
    pd.testing.assert_frame_equal(before, after)
    assert (tmp_path / "final" / "adapter_model.safetensors").read_bytes() == adapter


def test_a_second_run_on_one_output_dir_fails_at_once(chat_model, tmp_path):
    """A run holds its output_dir: another started on it fails before building anything,
    naming the first; once the first has died, a rerun proceeds (and would resume)."""
    from qerl.errors import QerlError
    from tests.test_atomic import holder

    proc = holder(tmp_path)
    try:
        with pytest.raises(QerlError, match=rf"being written by another process \(qerl train, "
                                            rf"pid {proc.pid}"):
            run(settings(chat_model, tmp_path))
        assert not (tmp_path / "config.yaml").exists()
    finally:
        proc.kill()
        proc.wait()


class Terminate(TrainerCallback):
    """SIGTERM to this process while a step runs, as a scheduler sends it."""

    def __init__(self, at_step: int):
        self.at_step = at_step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.at_step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_at_the_step_end_and_the_rerun_resumes(chat_model, tmp_path):
    """(That a resumed run repeats an undisturbed one exactly is the kill test's.)"""
    from qerl.rl.preemption import Preempted

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted, match=r"stopped by SIGTERM after step 1; checkpoint-1 is "
                                        r"saved .*run the same command to resume"):
        run(settings(chat_model, tmp_path), [Terminate(at_step=0)])
    assert last_checkpoint(tmp_path).name == "checkpoint-1"  # saves fall on even steps
    assert not (tmp_path / "final").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is undone
    run(settings(chat_model, tmp_path))
    assert list(pd.read_csv(tmp_path / METRICS).step) == [1, 2]
    assert (tmp_path / "final" / "adapter_model.safetensors").is_file()
