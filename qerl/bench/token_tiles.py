"""Time the Hopper NVFP4 GEMM with each token tile at each M, cuBLAS BF16 in the same run:
the measurements ``PASS_TOKENS`` in nvfp4_gemm.py (which tile ``token_tile`` picks) is
fitted to.

    qerl bench token-tiles               # -> results/bench/token_tiles_<card>.csv
    qerl bench token-tiles --models qwen2.5-7b --layers gate_up --m 160,192,256
"""

from __future__ import annotations

import torch

from qerl.bench.gpu_timing import rotating, time_us
from qerl.bench.layer_sweep import model_layers, record_sweep, say_times, sweep_arguments
from qerl.formats import nvfp4
from qerl.kernels import device_facts as facts
from qerl.kernels import nvfp4_gemm as gemm
from qerl.kernels import nvfp4_layout as layout
from qerl.record import per_card, provenance

MODELS = ("qwen2.5-7b", "qwen2.5-32b")
LAYERS = ("gate_up", "down")
M_VALUES = (96, 128, 160, 192, 256, 320, 384, 512, 1024, 2048)


def measure(n: int, k: int, m_values) -> list[dict]:
    """Rows of one (N, K) weight: each M and token tile against cuBLAS BF16, the blocks as
    ``launch_for`` sets them."""
    q = nvfp4.quantize(torch.randn(n, k, device="cuda") * 0.02)
    pairs = layout.to_pairs(q.packed)
    weight = rotating(lambda: (pairs.clone(), q.scale.clone(), q.global_scale.clone()),
                      n * k * 9 // 16)
    dense = rotating(lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16), 2 * n * k)
    sms = facts.num_sms(torch.device("cuda"))
    rows = []
    for m in m_values:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bf16 = time_us(lambda a=a: a @ dense().T)
        chosen = gemm.token_tile(m)
        timed = {}
        for bm in gemm.TOKEN_TILES[1:]:
            launch = gemm.launch_for(m, n, k, sms, bm)
            timed[bm] = time_us(lambda a=a, launch=launch: gemm.linear(a, *weight(), None, k,
                                                                         launch))
        rows += [{"M": m, "N": n, "K": k, "token_tile": bm, "chosen": int(bm == chosen),
                  "us": round(us, 2), "bf16_us": round(bf16, 2),
                  "speedup_vs_bf16": round(bf16 / us, 3)} for bm, us in timed.items()]
        say_times(f"{n}x{k} M={m}", bf16, timed)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = sweep_arguments("token-tiles", __doc__, MODELS, LAYERS, M_VALUES, argv)
    grid = model_layers("token-tiles", args.models, args.layers)
    if not gemm.available(torch.device("cuda")):
        raise SystemExit("qerl bench token-tiles: the Hopper GEMM cannot run here: "
                         f"{gemm.unavailable_reason(torch.device('cuda'))}")
    base = provenance("cuda")
    path = args.out_dir / per_card("token_tiles", base["card"])
    record_sweep(path, base, grid, lambda n, k: measure(n, k, args.m))
    print(path)


if __name__ == "__main__":
    main()
