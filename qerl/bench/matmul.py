"""Benchmark the NVFP4 matmul (the path its wrappers choose) against cuBLAS BF16 and a naive
dequantize-then-matmul, on the Qwen2.5 7B/14B/32B linear layers, forward and
input-gradient, for M from 1 to 8192.

    qerl bench kernels                   # -> results/bench/kernels_<card>.csv
    qerl bench kernels --models qwen2.5-7b --layers gate_up,down --m 1,16,64

Each row names the path the wrappers chose (``path``: cuda, triton or dequant) and, at the
sizes where the fused kernels run, the fused Triton forward's time beside it
(``triton_fused_us``). `qerl report` draws the speed-ups and tabulates them.

Every op is timed as CUDA-graph replays (as the rollout engine runs a decode step). Each
weight is replicated over buffers larger than the L2 cache and rotated between calls,
so every call reads its weight from HBM, as in a real forward pass. ``floor_us`` is the
fewest bytes the NVFP4 op must move (packed weight, scales, activations in and out) over the
device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from qerl.bench.gpu_timing import copy_bandwidth, rotating, time_us
from qerl.bench.layer_sweep import layer_shapes, sweep_arguments
from qerl.formats import nvfp4
from qerl.kernels import nvfp4_layout as layout
from qerl.kernels import nvfp4_matmul as km
from qerl.record import append_rows, per_card, provenance
from qerl.report.run import summary

M_VALUES = (1, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512, 2048, 8192)
MODELS = ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b")


class LayerBench:
    """One (N, K) weight, quantized once, timed for each op and M."""

    def __init__(self, n: int, k: int):
        self.n, self.k = n, k
        w = torch.randn(n, k, device="cuda") * 0.02
        self.q = nvfp4.quantize(w)
        self.w64 = nvfp4.dequantize(self.q, torch.float64)
        q = self.q
        pairs = layout.to_pairs(q.packed)
        self.packed = rotating(
            lambda: (pairs.clone(), q.scale.clone(), q.global_scale.clone()), n * k * 9 // 16)
        # The naive baseline dequantizes compressed-tensors' packing, as the original does.
        self.standard = rotating(
            lambda: (q.packed.clone(), q.scale.clone(), q.global_scale.clone()), n * k * 9 // 16)
        w_bf16 = w.to(torch.bfloat16)
        self.dense = rotating(lambda: w_bf16.clone(), 2 * n * k)

    def run(self, op: str, m: int) -> dict:
        fwd = op == "fwd"
        width, out_width = (self.k, self.n) if fwd else (self.n, self.k)
        a = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
        packed, standard, dense = self.packed, self.standard, self.dense
        if fwd:
            def ours():
                return km.nvfp4_linear(a, *packed())

            def bf16():
                return a @ dense().T

            def naive():
                return a @ nvfp4.dequantize(nvfp4.NVFP4Tensor(*standard())).T
        else:
            def ours():
                return km.nvfp4_linear_grad_input(a, *packed())

            def bf16():
                return a @ dense()

            def naive():
                return a @ nvfp4.dequantize(nvfp4.NVFP4Tensor(*standard()))

        ref = a.double() @ (self.w64.T if fwd else self.w64)
        err = ((ours().double() - ref).norm() / ref.norm()).item()
        nbytes = self.n * self.k * 9 // 16 + 2 * m * (width + out_width)
        path = km.forward_path(a, *packed()[:2]) if fwd else km.grad_input_path(a)
        triton_us = None
        if fwd and m <= km.FUSED_MAX_M:  # the fused Triton forward, the CUDA kernel's baseline
            triton_us = time_us(lambda: km.nvfp4_linear(a, *packed(), path="triton"))
        return {"path": path, "ours_us": time_us(ours), "bf16_us": time_us(bf16),
                "triton_us": triton_us, "naive_us": time_us(naive, graph=False),
                "nvfp4_bytes": nbytes, "rel_err": err}


def run(out_dir: Path, models=MODELS, m_values=M_VALUES, layers=None) -> Path:
    bandwidth = copy_bandwidth()
    base = provenance("cuda")
    path = out_dir / per_card("kernels", base["card"])
    for arch in models:
        rows = []
        for layer, (n, k) in layer_shapes(arch).items():
            if layers and layer not in layers:
                continue
            bench = LayerBench(n, k)
            for op, m in itertools.product(("fwd", "bwd"), m_values):
                r = bench.run(op, m)
                rows.append({**base, "copy_gbps": round(bandwidth / 1e9, 1), "model": arch,
                             "layer": layer, "op": op, "M": m, "N": n, "K": k,
                             "path": r["path"], "ours_us": round(r["ours_us"], 2),
                             "bf16_us": round(r["bf16_us"], 2),
                             "triton_fused_us": (round(r["triton_us"], 2)
                                                 if r["triton_us"] is not None else None),
                             "naive_us": round(r["naive_us"], 2),
                             "floor_us": round(1e6 * r["nvfp4_bytes"] / bandwidth, 2),
                             "speedup_vs_bf16": round(r["bf16_us"] / r["ours_us"], 3),
                             "rel_err": f"{r['rel_err']:.2e}"})
                print(f"{arch} {layer} {op} M={m}: ours {r['ours_us']:.1f} us, "
                      f"bf16 {r['bf16_us']:.1f} us, x{r['bf16_us'] / r['ours_us']:.2f}",
                      flush=True)
            del bench
            torch.cuda.empty_cache()
        append_rows(path, rows)
    return path


def main(argv: list[str] | None = None) -> None:
    args = sweep_arguments("kernels", __doc__, MODELS, None, M_VALUES, argv)
    path = run(args.out_dir, args.models.split(","), args.m,
               args.layers.split(",") if args.layers else None)
    print(summary("kernels", path))
    print(path)


if __name__ == "__main__":
    main()
