"""Every kind of benchmark result, registered once: the `qerl bench` command that writes its
rows and the module that runs it, the workflow rule that runs that command, and how
`qerl report` reads, names and tabulates its rows. The command line, the workflow's rules
and the report all read this list; a new benchmark is its module plus an entry here.

A kind whose rows something else writes (a script outside qerl, say) is registered
without a command: the report reads it all the same.

This module imports no benchmark (the report reads it, and benchmarks are a leaf).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from qerl.errors import QerlError

Device = Literal["cuda", "any", "cpu"]
Out = Literal["dir", "file"]


@dataclass(frozen=True)
class Benchmark:
    """One kind of benchmark result.

    ``name`` names its rows in the report (the first part of each values.csv key) and
    ``table`` the table that shows every row (default: ``name``; a table of that name that
    qerl.report.tables does not build itself lists each row's settings and numbers).
    ``patterns`` are its files below the results folder (``**``: any depth, so both the
    committed files and the workflow's ``bench/COMMAND/`` folders are read). A row is named
    by its ``method`` and ``model`` columns and the ``setting`` columns (joined into the
    key, a setting at its value in ``defaults`` left out: the value rows had before the
    column was written); ``metrics`` are the columns of its numbers. ``model_in_layer``:
    the layer column holds MODEL.LAYER (a layer sweep's rows); ``card``: the card of rows
    measured on none (an estimate's); ``model_from_path``: the model is the folder two
    above the file (the science rules' ``science/MODEL/entropy/``), not its model column.

    ``command`` runs it (`qerl bench COMMAND`, the ``main(argv)`` of ``module``); none
    where its rows are written outside qerl. ``rule`` is the workflow rule that runs the
    command: "bench" (config ``bench: {COMMAND: OPTIONS}``), another by name, or none.
    What the bench rule needs of it: ``out``, whether it writes a folder (--out-dir DIR)
    or one file (--out DIR/COMMAND.csv), and ``device``, where it runs: "cuda" on a GPU
    held whole (a timed measurement alone on its GPU), "any" on the configuration's device
    (a whole GPU where there is one), "cpu" on the CPU wherever it runs, no GPU held.
    """

    name: str
    patterns: tuple[str, ...]
    command: str | None = None
    module: str | None = None
    rule: str | None = None
    out: Out = "dir"
    device: Device = "cuda"
    table: str = ""
    method: str = "method"
    model: str = "model"
    setting: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    defaults: dict = field(default_factory=dict)
    model_in_layer: bool = False
    card: str | None = None
    model_from_path: bool = False

    def __post_init__(self) -> None:
        if (self.command is None) != (self.module is None):
            raise QerlError(f"benchmark {self.name}: a command and its module go together")
        if self.rule is not None and self.command is None:
            raise QerlError(f"benchmark {self.name}: rule {self.rule} runs no command")
        for what, value, kinds in (("out", self.out, Out), ("device", self.device, Device)):
            if value not in get_args(kinds):
                raise QerlError(f"benchmark {self.name}: {what} {value!r} is not one of "
                                f"{get_args(kinds)}")
        if not self.table:
            object.__setattr__(self, "table", self.name)


BENCHMARKS = (
    Benchmark("entropy", ("science/*/entropy/entropy_*.csv",), "entropy", "qerl.bench.entropy",
              rule="science_entropy", device="any", method="weights",
              setting=("prompts", "tokens", "sigma"),
              metrics=("own_entropy", "shared_entropy", "shared_minus_bf16"),
              model_from_path=True),
    # group: every prompt distinct before --group; kv_cache: BF16 before --kv-cache.
    Benchmark("rollout", ("bench/**/rollout_*.csv",), "rollout", "qerl.bench.rollout",
              rule="bench", method="weights",
              setting=("lora_rank", "batch", "group", "prompt_len", "gen_len", "fused",
                       "kv_cache"),
              metrics=("tok_per_s", "first_token_s", "step_ms", "peak_gb"),
              defaults={"group": 1, "kv_cache": "bf16"}),
    Benchmark("kernels", ("bench/**/kernels_*.csv",), "kernels", "qerl.bench.matmul",
              rule="bench", method="op", setting=("layer", "M"),
              metrics=("speedup_vs_bf16", "ceiling_vs_bf16", "ours_us", "bf16_us",
                       "triton_fused_us")),
    Benchmark("kernel_paths", ("bench/**/kernel_paths_*.csv",), "kernel-paths",
              "qerl.bench.kernel_paths", rule="bench", method="path",
              setting=("layer", "op", "M"), metrics=("speedup_vs_bf16", "us", "bf16_us"),
              model_in_layer=True),
    Benchmark("token_tiles", ("bench/**/token_tiles_*.csv",), "token-tiles",
              "qerl.bench.token_tiles", rule="bench", method="token_tile",
              setting=("layer", "M"), metrics=("speedup_vs_bf16", "us", "bf16_us"),
              model_in_layer=True),
    Benchmark("decode_step", ("bench/**/decode_step_*.csv",), "decode-step",
              "qerl.bench.decode_step", rule="bench", method="weights",
              setting=("lora_rank", "fused", "kv_cache", "batch", "context"),
              metrics=("step_ms", "kernels", "kernel_ms", "busy_ms", "matmul_ms", "lora_ms",
                       "attention_ms", "norm_ms", "other_ms", "sampling_ms", "prefill_ms",
                       "prefill_busy_ms"),
              defaults={"kv_cache": "bf16"}),  # BF16 before --kv-cache
    # busy: processes kept busy beside a CPU measurement (--busy); none before. memory_gb:
    # the budget the step was fitted to (--memory-gb); 0, none.
    Benchmark("step", ("bench/**/efficiency_*.csv",), "step", "qerl.bench.step", rule="bench",
              table="efficiency",
              setting=("lora_rank", "prompts", "generations", "completion", "micro_batch",
                       "grad_ckpt", "busy", "memory_gb", "kv_cache"),
              metrics=("step_s", "rollout_s", "score_s", "train_s", "optimizer_s",
                       "rollout_tok_per_s", "peak_gb", "threads", "speed_vs_lora"),
              defaults={"busy": 0, "memory_gb": 0, "kv_cache": "bf16"}),
    Benchmark("memory", ("bench/**/memory_*.csv",), "memory", "qerl.bench.memory",
              rule="bench", model="arch", setting=("lora_rank",),
              metrics=("weights_gb", "projections_gb", "dense_gb", "lora_gb",
                       "build_peak_gb")),
    Benchmark("quantize", ("bench/**/quantize*.csv",), "quantize", "qerl.bench.quantize",
              rule="bench", out="file", device="any", method="source", model="arch",
              metrics=("seconds", "load_only_s", "peak_rss_gb", "peak_rss_over_bf16",
                       "checkpoint_gb", "mean_rel_error")),
    Benchmark("fidelity", ("bench/**/fidelity*.csv",), "fidelity", "qerl.bench.fidelity",
              rule="bench", out="file", device="cpu", method="compared",
              setting=("reference", "questions", "greedy_tokens"),
              metrics=("top1_agreement", "mean_kl_nats", "greedy_equal",
                       "greedy_common_prefix")),
    Benchmark("footprint", ("bench/**/footprint_*.csv",), "footprint", "qerl.bench.footprint",
              rule="bench", device="cpu", card="estimate",
              setting=("prompts", "generations", "completion", "micro_batch", "lora_rank",
                       "measures"),
              metrics=("weights", "lora", "kv_cache", "checkpointed", "layer", "logprob",
                       "total", "measured_peak_gb"),
              defaults={"measures": "none"}),  # every row before --measures
    # The CPU's time to issue one NVFP4Linear forward, beside a baseline qerl's (--baseline).
    Benchmark("host_time", ("bench/**/host_time_*.csv",), "host-time", "qerl.bench.host_time",
              method="code", setting=("layer", "M"), metrics=("host_us", "host_vs_baseline")),
    # RL steps fitted to memory budgets, torch capped to each, and on the whole card: the
    # rows of fits.md, which model fits which card.
    Benchmark("budget", ("bench/**/budget_*.csv",), "budget", "qerl.bench.capped_step",
              rule="bench",
              setting=("memory_gb", "whole_card", "lora_rank", "prompts", "generations",
                       "completion", "prompt_tokens", "kernel_arch", "kv_cache"),
              metrics=("needs_gb", "rollout_batch", "micro_batch", "nvml_peak_gb",
                       "torch_peak_gb", "torch_reserved_gb", "step_s", "uncapped_step_s",
                       "time_vs_uncapped"),
              defaults={"kv_cache": "bf16"}),
    # The Docker image as .ci/image builds it and runs its smoke workflow (on the CPU), per
    # CUDA major.
    Benchmark("image", ("bench/**/image*.csv",), method="cuda", model="base",
              setting=("cores",), metrics=("build_s", "smoke_s", "image_gb", "torch_gb")),
)

# `qerl bench COMMAND` -> the module whose main(argv) runs it.
COMMANDS = {b.command: b.module for b in BENCHMARKS if b.command is not None}
