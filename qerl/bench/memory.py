"""GPU memory held by each method's policy weights (base + adapters, before any training
state), at real Qwen2.5 shapes with random weights: values do not change sizes.

    qerl bench memory                        # -> results/bench/memory_<card>.csv
    qerl bench memory --archs qwen2.5-7b --methods qerl,lora

``weights_gb`` is what the CUDA allocator holds once the policy is built (decimal GB);
``dense_gb`` the part left in BF16 by every method (embeddings, lm_head, norms, biases),
``lora_gb`` the adapters, ``projections_gb`` the rest: the decoder's projections in each
method's format (NF4's quantization statistics included).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from qerl.config import LoraSettings
from qerl.help_format import HelpFormatter
from qerl.methods import METHODS
from qerl.policy import build_policy
from qerl.record import append_rows, per_card, provenance

ARCHS = ("qwen2.5-3b", "qwen2.5-7b")
GB = 1e9


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def measure(method: str, arch: str, lora: LoraSettings) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    policy = build_policy(method, arch=arch, device="cuda", lora=lora)
    held = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    named = [*policy.model.named_parameters(), *policy.model.named_buffers()]
    lora_bytes = _tensor_bytes(t for n, t in named if "lora_" in n)
    dense_bytes = _tensor_bytes(t for n, t in named if "lora_" not in n and "_proj." not in n)
    del policy, named
    gc.collect()
    torch.cuda.empty_cache()
    return {"weights_gb": round(held / GB, 3), "projections_gb": round(
        (held - lora_bytes - dense_bytes) / GB, 3), "dense_gb": round(dense_bytes / GB, 3),
        "lora_gb": round(lora_bytes / GB, 3), "build_peak_gb": round(peak / GB, 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="qerl bench memory", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("results/bench"))
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--rank", type=int, default=LoraSettings().rank)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("qerl bench memory: needs a CUDA GPU (none found)")
    base = provenance("cuda")
    lora = LoraSettings(rank=args.rank, alpha=args.rank)
    rows = []
    for arch in args.archs.split(","):
        for method in args.methods.split(","):
            row = {**base, "arch": arch, "method": method,
                   "lora_rank": args.rank if method != "full" else 0,
                   **measure(method, arch, lora)}
            rows.append(row)
            print(f"{arch} {method}: {row['weights_gb']:.2f} GB (projections "
                  f"{row['projections_gb']:.2f}, dense {row['dense_gb']:.2f}, lora "
                  f"{row['lora_gb']:.3f}; build peak {row['build_peak_gb']:.2f})", flush=True)
    path = args.out_dir / per_card("memory", base["card"])
    append_rows(path, rows)
    print(path)


if __name__ == "__main__":
    main()
