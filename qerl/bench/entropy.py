"""Does quantization raise the policy's entropy? The mean token-level entropy of the
sampling distribution (temperature 1, as rollouts sample) on GSM8K test prompts, for one
model's weights in BF16, NVFP4, NF4, and NVFP4 with AQN's noise on the RMSNorms:

    qerl bench entropy --data tests/data/gsm8k_test.jsonl      # SmolLM2-135M-Instruct

Two measures, each a mean over prompts of the mean over a completion's tokens, with 95%
bootstrap intervals over prompts:
- own: each variant samples its own completions (what RL's rollouts see);
- shared: every variant scores the BF16 variant's completions (the same tokens, so only the
  distribution differs), with the paired difference to BF16.
Rows go to results/science/<model>/entropy/entropy_<card>.csv (the workflow's folder);
`qerl report` tabulates and draws them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from qerl.help_format import HelpFormatter

# Variant -> (method, AQN on). NF4 is the QLoRA base (bitsandbytes).
VARIANTS = {"bf16": ("full", False), "nvfp4": ("qerl", False), "nf4": ("qlora", False),
            "nvfp4+aqn": ("qerl", True)}


def token_entropies(model, prompt: list[int], completion: list[int]) -> np.ndarray:
    """Entropy (nats) of the next-token distribution at each completion position."""
    ids = torch.tensor([prompt + completion], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    logp = logits.log_softmax(-1)
    return (-(logp.exp() * logp).sum(-1)).cpu().numpy()


def bootstrap(values: np.ndarray, rng: np.random.Generator, draws: int = 2000):
    """The mean and its 95% percentile interval over resampled prompts."""
    means = rng.choice(values, size=(draws, len(values))).mean(axis=1)
    return float(values.mean()), float(np.percentile(means, 2.5)), float(
        np.percentile(means, 97.5))


def build(variant: str, model: str, sigma: float, device: str):
    from qerl.noise import AQNSettings
    from qerl.policy import build_policy

    method, noisy = VARIANTS[variant]
    if not noisy:
        return build_policy(method, model, device=device)
    # Two stages over two steps: step 1 is stage 1, whose sigma is sigma_start.
    policy = build_policy(method, model, device=device, total_steps=2,
                          aqn=AQNSettings(sigma_start=sigma, sigma_end=sigma, num_stages=2))
    policy.aqn.perturb(1)
    return policy


def measure(args) -> list[dict]:
    import tempfile

    from qerl.eval.run import stop_tokens
    from qerl.rl.data import load_task
    from qerl.rollout import Engine, SamplingParams
    from qerl.tokenizer import policy_tokenizer

    task = load_task("gsm8k", path=args.data, split=None, limit=args.prompts)
    rng = np.random.default_rng(args.seed)
    own, shared, sampled, prompts = {}, {}, {}, None
    for variant in args.weights.split(","):
        policy = build(variant, args.model, args.sigma, args.device)
        if prompts is None:  # the training prompt, rendered by the model's own tokenizer
            with tempfile.TemporaryDirectory() as tmp:
                tokenizer = policy_tokenizer(policy, Path(tmp), cpu=args.device == "cpu")
            texts = tokenizer.apply_chat_template(list(task["prompt"]), tokenize=False,
                                                  add_generation_prompt=True)
            prompts = tokenizer(texts, add_special_tokens=False)["input_ids"]
            params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0,
                                    seed=args.seed, stop_token_ids=stop_tokens(policy, tokenizer))
        engine = Engine(policy, max_batch=len(prompts),
                        max_seq_len=max(map(len, prompts)) + args.tokens)
        completions = engine.generate(prompts, params).tokens
        sampled[variant] = completions
        model = policy.model.eval()
        own[variant] = np.array([token_entropies(model, p, c).mean()
                                 for p, c in zip(prompts, completions, strict=True) if c])
        reference = sampled.get("bf16", completions)
        shared[variant] = np.array([token_entropies(model, p, c).mean()
                                    for p, c in zip(prompts, reference, strict=True) if c])
        del engine, policy, model
    rows = []
    for variant in own:
        mean, low, high = bootstrap(own[variant], rng)
        smean, slow, shigh = bootstrap(shared[variant], rng)
        row = {"weights": variant, "prompts": len(own[variant]), "tokens": args.tokens,
               "sigma": args.sigma if VARIANTS[variant][1] else 0.0,
               "own_entropy": mean, "own_low": low, "own_high": high,
               "shared_entropy": smean, "shared_low": slow, "shared_high": shigh}
        if "bf16" in shared and len(shared["bf16"]) == len(shared[variant]):
            diff = shared[variant] - shared["bf16"]
            row["shared_minus_bf16"], row["diff_low"], row["diff_high"] = bootstrap(diff, rng)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    import pandas as pd

    from qerl.noise import AQNSettings
    from qerl.record import per_card, provenance
    from qerl.report.run import summary

    parser = argparse.ArgumentParser(prog="qerl bench entropy", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", help="a local GSM8K test jsonl (default: the hub's)")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=128, help="completion length")
    parser.add_argument("--weights", default=",".join(VARIANTS))
    parser.add_argument("--sigma", type=float, default=AQNSettings().sigma_start,
                        help="AQN noise for +aqn (default: AQN's first noisy stage)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out-dir", type=Path,
                        help="default: results/science/<model's name>/entropy")
    args = parser.parse_args(argv)
    unknown = set(args.weights.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown weights {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    out_dir = args.out_dir or Path("results/science") / Path(args.model).name / "entropy"
    base = provenance(args.device)
    rows = [{**base, "model": args.model, **row} for row in measure(args)]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / per_card("entropy", base["card"])
    pd.DataFrame(rows).to_csv(path, index=False)
    print(summary("entropy", path))
    print(path)


if __name__ == "__main__":
    main()
