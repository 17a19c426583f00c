"""Time both paths of the NVFP4 matmul, the fused kernels and dequantize + cuBLAS, forward
and backward, on Qwen2.5 7B/32B layers for M from 1 to 128, to choose FUSED_MAX_M in
nvfp4_matmul.py.

    qerl bench kernel-paths              # -> results/bench/kernel_paths_<card>.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from qerl.bench.record import append_rows, provenance
from qerl.formats import nvfp4
from qerl.kernels import nvfp4_layout as layout
from qerl.kernels import nvfp4_matmul as km
from qerl.kernels.bench_nvfp4_matmul import copy_bandwidth, rotating, time_us

LAYERS = {"qwen2.5-7b.qkv": (4608, 3584), "qwen2.5-7b.gate_up": (37888, 3584),
          "qwen2.5-7b.down": (3584, 18944), "qwen2.5-32b.gate_up": (55296, 5120),
          "qwen2.5-32b.down": (5120, 27648)}
M_VALUES = (1, 4, 16, 32, 64, 128)
PATHS = {"fused": 1 << 30, "dequant+cublas": 0}  # FUSED_MAX_M forcing each path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="qerl bench kernel-paths", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("results/bench"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("qerl bench kernel-paths: needs a CUDA GPU (none found)")
    saved = km.FUSED_MAX_M
    bandwidth = copy_bandwidth()
    base = provenance("cuda")
    rows = []
    try:
        for name, (n, k) in LAYERS.items():
            q = nvfp4.quantize(torch.randn(n, k, device="cuda") * 0.02)
            pairs = layout.to_pairs(q.packed)
            weight = rotating(lambda q=q, p=pairs: (p.clone(), q.scale.clone(),
                                                     q.global_scale.clone()), n * k * 9 // 16)
            dense = rotating(lambda n=n, k=k: torch.randn(n, k, device="cuda",
                                                           dtype=torch.bfloat16), 2 * n * k)
            for op in ("fwd", "bwd"):
                for m in M_VALUES:
                    a = torch.randn(m, k if op == "fwd" else n, device="cuda",
                                    dtype=torch.bfloat16)
                    if op == "fwd":
                        bf16 = time_us(lambda a=a, d=dense: a @ d().T)
                        fn = km.nvfp4_linear
                    else:
                        bf16 = time_us(lambda a=a, d=dense: a @ d())
                        fn = km.nvfp4_linear_grad_input
                    for path, max_m in PATHS.items():
                        km.FUSED_MAX_M = max_m
                        us = time_us(lambda a=a, fn=fn, w=weight: fn(a, *w()))
                        rows.append({**base, "copy_gbps": round(bandwidth / 1e9, 1),
                                     "layer": name, "op": op, "M": m, "N": n, "K": k,
                                     "path": path, "us": round(us, 2),
                                     "bf16_us": round(bf16, 2),
                                     "speedup_vs_bf16": round(bf16 / us, 3),
                                     "floor_us": round(1e6 * n * k * 9 / 16 / bandwidth, 2)})
                    fused, deq = rows[-2], rows[-1]
                    print(f"{name} {op} M={m}: bf16 {bf16:.1f} us, fused {fused['us']:.1f}, "
                          f"dequant+cublas {deq['us']:.1f}", flush=True)
    finally:
        km.FUSED_MAX_M = saved
    path = args.out_dir / f"kernel_paths_{base['card'].replace(' ', '_')}.csv"
    append_rows(path, rows)
    print(path)


if __name__ == "__main__":
    main()
