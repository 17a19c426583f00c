"""Time every small-M path of the NVFP4 matmul (GEMV tiles, fused tl.dot, dequantize +
cuBLAS) on 7B/32B gate_up and down, to choose GEMV_MAX_M, SKINNY_MAX_M and the GEMV tiles
in nvfp4_matmul.py.

    qerl bench kernel-paths              # -> results/bench/kernel_paths_<card>.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from qerl.bench.record import append_rows, provenance
from qerl.formats import nvfp4
from qerl.kernels import nvfp4_matmul as km
from qerl.kernels.bench_nvfp4_matmul import copy_bandwidth, rotating, time_us

LAYERS = {"qwen2.5-7b.gate_up": (37888, 3584), "qwen2.5-7b.down": (3584, 18944),
          "qwen2.5-32b.gate_up": (55296, 5120), "qwen2.5-32b.down": (5120, 27648)}
GEMV_TILES = ((16, 512, 4, 3), (8, 1024, 4, 3), (32, 256, 4, 3), (16, 1024, 4, 3),
              (32, 512, 8, 3), (64, 256, 8, 3))
M_VALUES = (1, 2, 4, 8, 16, 32, 64)


def _force(gemv_max_m: int, skinny_max_m: int, tile=None) -> None:
    km.GEMV_MAX_M, km.SKINNY_MAX_M = gemv_max_m, skinny_max_m
    if tile is not None:
        km.GEMV_TILE_WIDE = km.GEMV_TILE_TALL = tile


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="qerl bench kernel-paths", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("results/bench"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("qerl bench kernel-paths: needs a CUDA GPU (none found)")
    saved = (km.GEMV_MAX_M, km.SKINNY_MAX_M, km.GEMV_TILE_WIDE, km.GEMV_TILE_TALL)
    bandwidth = copy_bandwidth()
    base = provenance("cuda")
    rows = []
    try:
        for layer, (n, k) in LAYERS.items():
            q = nvfp4.quantize(torch.randn(n, k, device="cuda") * 0.02)
            packed = rotating(lambda q=q: (q.packed.clone(), q.scale.clone(),
                                            q.global_scale.clone()), n * k * 9 // 16)
            dense = rotating(lambda n=n, k=k: torch.randn(n, k, device="cuda",
                                                           dtype=torch.bfloat16), 2 * n * k)
            for m in M_VALUES:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                bf16 = time_us(lambda x=x, dense=dense: x @ dense().T)
                paths = [("gemv", tile) for tile in GEMV_TILES if m <= 8]
                paths += [("dot", None), ("dequant+cublas", None)]
                for path, tile in paths:
                    _force(*{"gemv": (m, m), "dot": (0, m), "dequant+cublas": (0, 0)}[path],
                           tile)
                    us = time_us(lambda x=x, p=packed: km.nvfp4_linear(x, *p()))
                    rows.append({**base, "copy_gbps": round(bandwidth / 1e9, 1),
                                 "layer": layer, "M": m, "N": n, "K": k, "path": path,
                                 "tile": "x".join(map(str, tile)) if tile else "",
                                 "us": round(us, 2), "bf16_us": round(bf16, 2),
                                 "speedup_vs_bf16": round(bf16 / us, 3),
                                 "floor_us": round(1e6 * n * k * 9 / 16 / bandwidth, 2)})
                best = min((r for r in rows if r["layer"] == layer and r["M"] == m),
                           key=lambda r: r["us"])
                print(f"{layer} M={m}: bf16 {bf16:.1f} us, best {best['path']} "
                      f"{best['tile']} {best['us']:.1f} us", flush=True)
    finally:
        km.GEMV_MAX_M, km.SKINNY_MAX_M, km.GEMV_TILE_WIDE, km.GEMV_TILE_TALL = saved
    path = args.out_dir / f"kernel_paths_{base['card'].replace(' ', '_')}.csv"
    append_rows(path, rows)
    print(path)


if __name__ == "__main__":
    main()
