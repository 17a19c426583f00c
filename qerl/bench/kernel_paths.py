"""Time every path of the NVFP4 matmul at each M, forward (the CUDA kernel where it builds
and M fits, the Hopper GEMM where it runs, the fused Triton kernel, dequantize + cuBLAS)
and input gradient (Triton, dequantize + cuBLAS), with cuBLAS BF16 in the same run: the
measurements the crossovers ``CUDA_MAX_M`` and ``FUSED_MAX_M`` in nvfp4_matmul.py are read
from, and the Hopper GEMM's per shape (``python -m qerl.kernels.crossovers`` turns the CSVs
into the ``crossovers.json`` the package ships).

    qerl bench kernel-paths              # -> results/bench/kernel_paths_<card>.csv
    qerl bench kernel-paths --models qwen2.5-7b --layers gate_up --m 16,32,48,64
"""

from __future__ import annotations

import torch

from qerl.bench.gpu_timing import copy_bandwidth, rotating, time_us
from qerl.bench.layer_sweep import model_layers, record_sweep, say_times, sweep_arguments
from qerl.formats import nvfp4
from qerl.kernels import nvfp4_layout as layout
from qerl.kernels import nvfp4_matmul as km
from qerl.record import per_card, provenance

MODELS = ("qwen2.5-7b", "qwen2.5-32b")
LAYERS = ("qkv", "gate_up", "down")
M_VALUES = (1, 16, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048)


def paths(op: str, a: torch.Tensor, pairs: torch.Tensor, scale: torch.Tensor
          ) -> tuple[str, ...]:
    """The paths that can run op (fwd | bwd) on the rows ``a`` here."""
    if op == "bwd":
        return km.GRAD_INPUT_PATHS
    runs = {"cuda": km.cuda_runs(a), "gemm": km.gemm_runs(a, scale, pairs)}
    return tuple(p for p in km.FORWARD_PATHS if runs.get(p, True))


def measure(n: int, k: int, m_values, bandwidth: float) -> list[dict]:
    """Rows of one (N, K) weight: each op, M and path against cuBLAS BF16."""
    q = nvfp4.quantize(torch.randn(n, k, device="cuda") * 0.02)
    pairs = layout.to_pairs(q.packed)
    weight = rotating(lambda: (pairs.clone(), q.scale.clone(), q.global_scale.clone()),
                      n * k * 9 // 16)
    dense = rotating(lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16), 2 * n * k)
    rows = []
    for op in ("fwd", "bwd"):
        fn = km.nvfp4_linear if op == "fwd" else km.nvfp4_linear_grad_input
        for m in m_values:
            a = torch.randn(m, k if op == "fwd" else n, device="cuda", dtype=torch.bfloat16)
            bf16 = time_us(lambda a=a: a @ dense().T) if op == "fwd" else time_us(
                lambda a=a: a @ dense())
            timed = {path: time_us(lambda a=a, fn=fn, path=path: fn(a, *weight(), path=path))
                     for path in paths(op, a, pairs, q.scale)}
            rows += [{"op": op, "M": m, "N": n, "K": k, "path": path, "us": round(us, 2),
                      "bf16_us": round(bf16, 2), "speedup_vs_bf16": round(bf16 / us, 3),
                      "floor_us": round(1e6 * n * k * 9 / 16 / bandwidth, 2)}
                     for path, us in timed.items()]
            say_times(f"{n}x{k} {op} M={m}", bf16, timed)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = sweep_arguments("kernel-paths", __doc__, MODELS, LAYERS, M_VALUES, argv)
    grid = model_layers("kernel-paths", args.models, args.layers)
    bandwidth = copy_bandwidth()
    base = provenance("cuda")
    path = args.out_dir / per_card("kernel_paths", base["card"])
    record_sweep(path, base, grid, lambda n, k: measure(n, k, args.m, bandwidth),
                 copy_gbps=round(bandwidth / 1e9, 1))
    print(path)


if __name__ == "__main__":
    main()
