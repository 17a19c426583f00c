"""A memory budget (qerl.rl.budget): the plan for the Qwen2.5 shapes against arithmetic
written here from their config.json fields, the refusal's numbers, the configuration's
checks, the cap on a GPU, and `qerl train --memory-gb` on a tiny model on the CPU, where
the plan is applied but not enforced."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from qerl.archs import config_for
from qerl.cli import main as cli
from qerl.config import ConfigError, parse_config
from qerl.rl import budget
from qerl.rl.budget import ALLOCATOR_SLACK, CUDA_CONTEXT_GB, BudgetError, plan_step
from qerl.rl.run import MEMORY_PLAN, METRICS
from tests.rl.test_train import settings

pytestmark = pytest.mark.usefixtures("reference_kernels")

ARCHS = Path(__file__).resolve().parents[2] / "qerl" / "archs"


def bytes_of(fields: dict, method: str, sequences: int, micro_batch: int, prompt: int,
             completion: int, rank: int, optimizer_bytes: int = 8,
             measures: tuple[str, ...] = (), kv_cache: str = "bf16") -> dict[str, float]:
    """One step's terms in bytes from a config.json's fields, as the footprint defines
    them (its docstring), written out weight by weight; ``measures``: the plan's
    (budget.MEASURES), with the KV cache freed while training marked by a zero-sized
    "released" term; an fp8 ``kv_cache``, a byte a key or value and two fp32 scales a
    (layer, kv head) of a sequence."""
    h, inter = fields["hidden_size"], fields["intermediate_size"]
    layers, vocab = fields["num_hidden_layers"], fields["vocab_size"]
    head = fields.get("head_dim") or h // fields["num_attention_heads"]
    q, kv = fields["num_attention_heads"] * head, fields["num_key_value_heads"] * head
    # q, k, v, o; gate, up, down: (in, out) each
    linears = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    weights = layers * sum(i * o for i, o in linears)
    tables = 1 if fields["tie_word_embeddings"] or "offload.embedding" in measures else 2
    embeddings = vocab * h * tables
    if "offload.optimizer" in measures:  # the two moments in the host's memory
        optimizer_bytes = 0
    per_weight = 2 if method == "lora" else 4 / 8 + 1 / 16  # nibble + a byte per 16
    adapter = layers * sum(rank * i + rank * o for i, o in linears)
    tokens = prompt + completion
    scored = micro_batch * completion
    # BF16 tensors a token of a layer's recompute (qlora: PEFT's fp32 input copies)
    per_token = 6 * inter + 20 * h if method == "qlora" else 4 * inter + 8 * h
    return {
        "weights": weights * per_weight + embeddings * 2,
        "lora": adapter * (4 + 4 + optimizer_bytes),
        "kv_cache": (sequences * tokens * layers * (kv + kv) * 2 if kv_cache == "bf16" else
                     sequences * layers * (tokens * (kv + kv) + 2 * kv // head * 4)),
        # offloaded: only the layer input brought back for its recompute
        "checkpointed": micro_batch * tokens * h * 2
        * (1 if "offload.activations" in measures else layers),
        # and a 4-bit base's largest projection decoded to BF16 for its GEMM
        "layer": micro_batch * tokens * per_token * 2
        + (0 if method == "lora" else max(i * o for i, o in linears) * 2),
        "logprob": min(scored, 4096) * min(vocab, 32768) * 2 + scored * h * 6,
        **({"released": 0} if "engine.release_cache" in measures else {}),
    }


def total_gb(terms: dict[str, float]) -> float:
    training = terms["checkpointed"] + max(terms["layer"], terms["logprob"])
    held = (max(terms["kv_cache"], training) if "released" in terms
            else terms["kv_cache"] + training)
    return (terms["weights"] + terms["lora"] + held) / 1e9


def driver_gb(terms: dict[str, float]) -> float:
    """The budget a step of ``terms`` needs as the driver counts it: the footprint, the
    allocator's slack on it and the CUDA context."""
    return total_gb(terms) * (1 + ALLOCATOR_SLACK) + CUDA_CONTEXT_GB


# The measures in the order a plan may take them, and which a model can (an untied
# embedding; AdamW in fp32, the only optimizer these tests plan).
MEASURES = ("offload.embedding", "engine.release_cache", "offload.optimizer",
            "offload.activations")


def expected_plan(fields, method, budget_gb, completions, max_micro, prompt, completion, rank,
                  kv_cache="bf16"):
    """None where nothing fits; else (rollout batch, micro-batch, measures): of every
    first-k of the measures and pair that fits (micro-batches dividing the completions),
    the fewest rollout rounds, then the fewest measures, then the fewest sequences that
    take that many rounds, then the largest micro-batch."""
    options = MEASURES[1:] if fields["tie_word_embeddings"] else MEASURES
    fitting = [(r, m, options[:k]) for k in range(len(options) + 1)
               for r in range(1, completions + 1) for m in range(1, max_micro + 1)
               if completions % m == 0 and driver_gb(bytes_of(
                   fields, method, r, m, prompt, completion, rank,
                   measures=options[:k], kv_cache=kv_cache)) <= budget_gb]
    if not fitting:
        return None
    return min(fitting, key=lambda p: (math.ceil(completions / p[0]), len(p[2]), p[0], -p[1]))


@pytest.mark.parametrize("arch", ["qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b"])
@pytest.mark.parametrize("budget_gb", [8, 16, 32, 56])
@pytest.mark.parametrize("method", ["qerl", "qlora", "lora"])
@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_the_plan_for_each_qwen_size_and_budget_matches_the_arithmetic(arch, budget_gb, method,
                                                                       kv_cache):
    """The issue's grid: one prompt x 8 completions of 2048 tokens after 64, LoRA rank 32."""
    fields = json.loads((ARCHS / f"{arch}.json").read_text())
    want = expected_plan(fields, method, budget_gb, 8, 8, 64, 2048, 32, kv_cache)
    kwargs = {"budget_gb": budget_gb, "method": method, "completions": 8,
              "max_micro_batch": 8, "prompt_len": 64, "completion": 2048, "rank": 32,
              "kv_cache": kv_cache}
    if want is None:
        with pytest.raises(BudgetError, match="The smallest budget that fits"):
            plan_step(config_for(arch), **kwargs)
        return
    plan = plan_step(config_for(arch), **kwargs)
    assert (plan.rollout_batch, plan.micro_batch, plan.measures) == want
    assert plan.kv_cache == plan.as_dict()["kv_cache"] == kv_cache
    rollout, micro, measures = want
    terms = bytes_of(fields, method, rollout, micro, 64, 2048, 32, measures=measures,
                     kv_cache=kv_cache)
    for name, value in terms.items():
        if name != "released":
            assert plan.terms[name] == pytest.approx(value / 1e9, rel=1e-12), name
    assert plan.needs_gb == pytest.approx(driver_gb(terms), rel=1e-12)
    assert plan.needs_gb <= budget_gb


def test_what_fits_where_at_the_issues_targets():
    """The verdicts the arithmetic above gives at the issue's targets, with the slack and
    context allowance: QeRL and QLoRA plan each model into its budget, 14B and 32B in one
    rollout round, 7B and 72B in two (QeRL in one with an fp8 KV cache), 7B only with the
    checkpointed layer inputs in the host's memory; BF16 LoRA none of the four."""
    def plan(arch, budget_gb, method, kv_cache="bf16"):
        fields = json.loads((ARCHS / f"{arch}.json").read_text())
        return expected_plan(fields, method, budget_gb, 8, 8, 64, 2048, 32, kv_cache)

    targets = [("qwen2.5-7b", 8), ("qwen2.5-14b", 16), ("qwen2.5-32b", 32), ("qwen2.5-72b", 56)]
    def rollouts(method, kv_cache="bf16"):
        return [(plan(a, b, method, kv_cache) or [None])[0] for a, b in targets]

    assert rollouts("qerl") == [4, 8, 8, 4]
    assert rollouts("qerl", "fp8") == [8, 8, 8, 8]
    assert rollouts("qlora") == [4, 8, 8, 4]
    assert "offload.activations" in plan("qwen2.5-7b", 8, "qerl")[2]
    assert not any(plan(a, b, "lora") for a, b in targets)


def test_a_refusal_names_each_term_and_the_smallest_budget():
    fields = json.loads((ARCHS / "qwen2.5-7b.json").read_text())
    smallest = bytes_of(fields, "qerl", 1, 1, 64, 2048, 32, measures=MEASURES)
    need = math.ceil(driver_gb(smallest) * 100) / 100
    kwargs = {"method": "qerl", "completions": 8, "max_micro_batch": 8, "prompt_len": 64,
              "completion": 2048, "rank": 32}
    with pytest.raises(BudgetError) as refused:
        plan_step(config_for("qwen2.5-7b"), budget_gb=7, **kwargs)
    message = str(refused.value)
    gb = {k: v / 1e9 for k, v in smallest.items() if k != "released"}
    for words in (f"weights {gb['weights']:.2f}", f"LoRA and optimizer {gb['lora']:.2f}",
                  f"KV cache {gb['kv_cache']:.2f}",
                  f"checkpointed inputs {gb['checkpointed']:.2f}",
                  f"one layer's recompute {gb['layer']:.2f}",
                  f"log-prob tiles {gb['logprob']:.2f}",
                  f"allocator's slack {total_gb(smallest) * ALLOCATOR_SLACK:.2f} (10% of "
                  "those)", f"CUDA context allowance of {CUDA_CONTEXT_GB:.2f}",
                  "does not fit memory_gb 7", "gradient checkpointing and offload.embedding, "
                  "engine.release_cache, offload.optimizer, offload.activations) it needs",
                  f"The smallest budget that fits: {need:.2f} GB"):
        assert words in message
    # At that budget the step fits with every measure (the released cache then holds more
    # than one sequence: the training's activations need more room than one's keys).
    assert plan_step(config_for("qwen2.5-7b"), budget_gb=need, **kwargs).measures == MEASURES
    with pytest.raises(BudgetError):
        plan_step(config_for("qwen2.5-7b"), budget_gb=need - 0.01, **kwargs)


def test_eight_bit_adam_counts_ten_bytes_an_adapter_weight():
    fields = json.loads((ARCHS / "qwen2.5-7b.json").read_text())
    plan = plan_step(config_for("qwen2.5-7b"), budget_gb=80, method="qerl", completions=8,
                     max_micro_batch=8, prompt_len=64, completion=2048, rank=32,
                     optimizer="adamw_8bit")
    assert plan.terms["lora"] * 1e9 == pytest.approx(
        bytes_of(fields, "qerl", 8, 8, 64, 2048, 32, optimizer_bytes=2)["lora"])


def test_the_budget_is_checked_with_the_rest_of_the_configuration(tmp_path):
    base = settings("m", tmp_path)
    for extra, words in (({"method": "full"}, "memory_gb plans the LoRA methods"),
                         ({"engine": {"kv_budget_gb": 1.0}}, "leave engine.kv_budget_gb unset"),
                         ({"engine": {"max_batch": 2}}, "leave engine.max_batch unset"),
                         ({"engine": {"backend": "vllm"}}, "vLLM sizes its own"),
                         ({"memory_gb": 0}, "memory_gb")):
        with pytest.raises(ConfigError, match=words):
            parse_config({**base, "memory_gb": 8, **extra})


def test_the_plan_takes_the_configurations_kv_cache(tmp_path):
    """engine.kv_cache is the user's and stays as given; the plan sizes the cache in it: 72B's
    eight completions of 2048 tokens in one round at 56 GB in fp8, in two in bf16."""
    raw = settings("m", tmp_path)
    raw["rl"].update(num_generations=8, max_prompt_length=64, max_completion_length=2048)
    raw["train"].update(batch_size=8, gradient_accumulation_steps=1)
    raw["lora"]["rank"] = 32
    rounds = {}
    for kv_cache in ("bf16", "fp8"):
        config = parse_config({**raw, "memory_gb": 56, "engine": {"kv_cache": kv_cache}})
        planned, plan = budget.fit(config, config_for("qwen2.5-72b"))
        assert plan.kv_cache == planned.engine.kv_cache == kv_cache
        assert f"a {kv_cache} KV cache" in plan.describe()
        rounds[kv_cache] = (plan.rollout_batch, planned.engine.max_batch)
    assert rounds == {"bf16": (4, 4), "fp8": (8, 8)}


def test_on_a_gpu_the_budget_caps_torch_at_the_budget_less_the_allowance(monkeypatch):
    """enforce's arithmetic, with a card's facts stood in: an 80 GB card (decimal) and a
    16 GB budget give torch 15 GB, 15/80 of it; a budget over the card is refused."""
    calls = []
    props = type("Props", (), {"total_memory": 80e9})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: calls.append((fraction, device)))
    plan = plan_step(config_for("qwen2.5-7b"), budget_gb=16, method="qerl", completions=8,
                     max_micro_batch=8, prompt_len=64, completion=2048, rank=32)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    said = budget.enforce(plan, "cuda:0")
    budget.enforce(plan, "cuda")  # as `qerl train` names it: the current device's index
    fraction = pytest.approx((16 - CUDA_CONTEXT_GB) / 80)
    assert calls == [(fraction, torch.device("cuda", 0)), (fraction, torch.device("cuda", 3))]
    assert "set_per_process_memory_fraction(0.1875)" in said and "at 15.00 of its 80.00 GB" in said
    over = budget.Plan(96, CUDA_CONTEXT_GB, 8, 8, 8, plan.terms)
    with pytest.raises(BudgetError, match="memory_gb 96 is more than cuda:0 holds"):
        budget.enforce(over, "cuda:0")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_torch_cannot_allocate_past_the_cap():
    plan = plan_step(config_for("tiny-llama"), budget_gb=2, method="qerl", completions=2,
                     max_micro_batch=2, prompt_len=16, completion=16, rank=4)
    # The cap is checked where the allocator asks the driver for memory: blocks earlier
    # tests left cached would be handed out unchecked.
    torch.cuda.empty_cache()
    budget.enforce(plan, "cuda")  # the current device, as `qerl train` names it
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(int((2 - CUDA_CONTEXT_GB) * 1e9) + 1, dtype=torch.uint8, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def tiny_budget(model_dir: Path, raw: dict, sequences: int, micro_batch: int) -> float:
    """The budget that holds ``sequences`` in the rollout's cache and ``micro_batch`` a
    forward, and not one more of either, by the arithmetic above."""
    fields = json.loads((model_dir / "config.json").read_text())
    rl, rank = raw["rl"], raw["lora"]["rank"]
    need = driver_gb(bytes_of(fields, raw["method"], sequences, micro_batch,
                              rl["max_prompt_length"], rl["max_completion_length"], rank))
    return need + 1e-7  # under any term's step at this size (~1e-5 GB)


def test_qerl_train_memory_gb_on_the_cpu_applies_the_plan(chat_model, tmp_path, capsys,
                                                          monkeypatch):
    """On the CPU the plan's settings are applied and not enforced: at a budget that holds
    two of the step's four completions in the KV cache beside a micro-batch of one, the
    plan takes the memory measures that let the rollout hold all four (the arithmetic
    above says which), and the run takes them: the input embedding in host memory, the
    KV cache freed after each step's rollouts, the optimizer's state in host memory. The
    log says so and memory_plan.json records it. The training forward never computes
    logits over every position through lm_head (TRL's fused head scores in tiles; the
    rollout computes only each sequence's last)."""
    from qerl.nn.host_embedding import HostEmbedding
    from qerl.rl.host_optimizer import HostAdamW

    raw = settings(chat_model, tmp_path / "out", "qerl")
    memory_gb = tiny_budget(chat_model, raw, sequences=2, micro_batch=1)
    fields = json.loads((chat_model / "config.json").read_text())
    rollout, micro, measures = expected_plan(fields, "qerl", memory_gb, 4, 4, 48, 6, 4)
    assert rollout == 4 and measures  # the measures are what saves the second round
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    from qerl.rl import run

    seen, built = [], []
    real_build = run.build_trainer

    def build_trainer(config, callbacks=None):
        trainer = real_build(config, callbacks)
        trainer.policy.base_model.lm_head.register_forward_hook(
            lambda module, args, out: seen.append(tuple(out.shape)))
        built.append(trainer)
        return trainer

    monkeypatch.setattr(run, "build_trainer", build_trainer)
    assert cli(["train", "--config", str(path), "--memory-gb", repr(memory_gb)]) == 0
    trainer, said = built[0], capsys.readouterr().out
    assert "memory budget" in said and "planned, not enforced" in said
    assert ", ".join(measures) in said
    plan = json.loads((tmp_path / "out" / MEMORY_PLAN).read_text())
    assert (plan["rollout_batch"], plan["micro_batch"], plan["completions"]) == (4, micro, 4)
    assert plan["measures"] == list(measures)
    assert plan["context_measured"] is False and plan["needs_gb"] <= memory_gb
    args = trainer.args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (micro,
                                                                                   4 // micro)
    assert args.gradient_checkpointing and trainer._engine.max_batch == 4
    base = trainer.policy.base_model
    assert isinstance(base.get_input_embeddings(), HostEmbedding) == (
        "offload.embedding" in measures)
    assert (trainer._engine.cache is None) == ("engine.release_cache" in measures)
    assert isinstance(trainer.optimizer.optimizer, HostAdamW) == (
        "offload.optimizer" in measures)
    assert list(pd.read_csv(tmp_path / "out" / METRICS).step) == [1, 2]
    # config.yaml keeps the settings as given: a rerun plans them again and resumes.
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["train"][
        "batch_size"] == 4
    assert seen and all(shape[1] == 1 and shape[0] <= 4 for shape in seen), seen


def test_a_step_that_cannot_fit_is_refused_before_any_model_is_built(chat_model, tmp_path,
                                                                     monkeypatch):
    from qerl.rl import run

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(run, "build_policy", no_model)
    raw = {**settings(chat_model, tmp_path / "out"), "memory_gb": CUDA_CONTEXT_GB}
    with pytest.raises(BudgetError, match=r"does not fit memory_gb 1: .* The smallest budget "
                                          r"that fits: 1\.01 GB"):
        run.train(parse_config(raw))
    assert not (tmp_path / "out" / MEMORY_PLAN).exists()
