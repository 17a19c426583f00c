"""Host time of the NVFP4 projections: what the CPU spends issuing one NVFP4Linear forward
(the route by M, the checks, the kernels' launches) at decode and prefill rows, the GPU
kept busy meanwhile so that no launch waits for it. A prefill (and a decode step outside a
CUDA graph) pays it at every layer.

With ``--baseline DIR`` the same measurement also runs, in a subprocess of the same run,
under the qerl installed in DIR (e.g. the commit before a change to the launch path), and
each row of ours gets ``host_vs_baseline``, our time over the baseline's.

    qerl bench host-time                      # -> results/bench/host_time_<card>.csv
    qerl bench host-time --baseline /tmp/before/site-packages --baseline-commit COMMIT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from qerl.bench.layer_sweep import model_layers, sweep_arguments
from qerl.formats import nvfp4
from qerl.nn import NVFP4Linear
from qerl.record import append_rows, per_card, provenance

MODELS = ("qwen2.5-7b",)
LAYERS = ("qkv", "o", "gate_up", "down")
M_VALUES = (8, 32, 2048)  # decode rows (the CUDA kernel) and a prefill's (the Hopper GEMM)
CALLS = 100  # forwards issued per sample: their launches stay well inside the launch queue
SAMPLES = 11
BUSY_CYCLES = 200_000_000  # the GPU spins this long (~0.1 s) under each sample's calls


def host_us(layer: torch.nn.Module, x: torch.Tensor) -> float:
    """The least over SAMPLES of the host time per forward, CALLS forwards issued while the
    GPU is still spinning (torch.cuda._sleep), so the time is the CPU's alone. The least:
    what else the machine does only ever adds to a sample."""
    samples = []
    with torch.no_grad():
        layer(x)  # builds, loads and compiles whatever the path needs
        for _ in range(SAMPLES):
            torch.cuda.synchronize()
            torch.cuda._sleep(BUSY_CYCLES)
            start = time.perf_counter()
            for _ in range(CALLS):
                layer(x)
            samples.append((time.perf_counter() - start) / CALLS * 1e6)
    torch.cuda.synchronize()
    return min(samples)


def measure(grid: list, m_values: list[int]) -> list[dict]:
    """One row per (model, layer, M): a random NVFP4 weight of the layer's shape."""
    rows = []
    for arch, layer, (n, k) in grid:
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        module = NVFP4Linear(nvfp4.quantize(linear.weight.detach().float()))
        del linear
        for m in m_values:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            rows.append({"model": arch, "layer": layer, "N": n, "K": k, "M": m,
                         "host_us": round(host_us(module, x), 2)})
        del module
        torch.cuda.empty_cache()
    return rows


def baseline_rows(site: str, grid: list, m_values: list[int]) -> list[dict]:
    """``measure`` under the qerl in ``site``: this file run by path in a subprocess whose
    qerl is that one (its rows as JSON on the last line of its output)."""
    # Its qerl first; what else it imports (compressed-tensors, ...) from our path.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])}
    code = ("import runpy, sys; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code, __file__, json.dumps([grid, m_values])],
                          env=env, capture_output=True, text=True, check=False, cwd="/")
    if done.returncode != 0:
        raise SystemExit(f"qerl bench host-time: the baseline in {site} failed:\n"
                         f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", metavar="DIR",
                        help="a site-packages folder holding the qerl to compare with")
    parser.add_argument("--baseline-commit", help="the baseline's commit, for its rows")


def main(argv: list[str] | None = None) -> None:
    args = sweep_arguments("host-time", __doc__, MODELS, LAYERS, M_VALUES, argv, _options)
    grid = model_layers("host-time", args.models, args.layers)
    base = provenance("cuda")
    ours = [{**base, "code": "this", **row} for row in measure(grid, args.m)]
    rows = ours
    if args.baseline:
        theirs = baseline_rows(args.baseline, grid, args.m)
        before = {(r["model"], r["layer"], r["M"]): r["host_us"] for r in theirs}
        for row in ours:
            key = row["model"], row["layer"], row["M"]
            row["host_vs_baseline"] = round(row["host_us"] / before[key], 3)
        label = args.baseline_commit or args.baseline
        rows = ours + [{**base, "qerl": label, "qerl_source": "", "code": "baseline", **r}
                       for r in theirs]
    path = args.out_dir / per_card("host_time", ours[0]["card"])
    append_rows(path, rows)
    for row in rows:
        print(f"{row['code']:>8} {row['layer']:>7} M={row['M']:<5} {row['host_us']:8.1f} us"
              + (f"  x{row['host_vs_baseline']}" if "host_vs_baseline" in row else ""))
    print(path)


if __name__ == "__main__":  # run by path under a baseline's qerl (baseline_rows)
    print(json.dumps(measure(*json.loads(sys.argv[1]))))
