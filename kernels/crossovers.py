"""Up to how many rows the Hopper GEMM beats the other paths, per card and weight shape,
read from `qerl bench kernel-paths` (``results/bench/kernel_paths_<card>.csv``).

Decoding a weight once and running cuBLAS costs a decode that grows with N x K plus a BF16
GEMM; the GEMM's own time grows with M. So where it stops winning depends on the shape and
the card, and is measured, not set: ``python -m qerl.kernels.crossovers CSV ...`` writes
what the path sweeps show into ``crossovers.json`` (shipped with the package), and a test
checks that the file is what the committed sweeps give. A shape not measured takes the
crossover of the nearest measured one (N and K on a log scale: a wide gate_up and a narrow
down of the same size split differently); a card not measured, a measured card's (every
card with GEMM rows is a Hopper card, the only ones it runs on).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
from collections import defaultdict
from pathlib import Path

import torch

DATA = Path(__file__).with_name("crossovers.json")
# The GEMM is compared from this many rows on; below, the small-M kernels run (CUDA_MAX_M,
# FUSED_MAX_M in nvfp4_matmul, which imports this module: kept equal by a test).
FROM_M = 33


def from_rows(rows: list[dict]) -> dict[str, dict[str, int]]:
    """{card: {"N,K": most rows}} from path-sweep rows (forward): a shape's most rows is the
    largest M from FROM_M up to which the GEMM is the fastest path at every measured M
    (FROM_M - 1: it never is)."""
    times: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["op"] == "fwd" and int(r["M"]) >= FROM_M:
            key = (r["card"], f"{int(r['N'])},{int(r['K'])}", int(r["M"]))
            times[key][r["path"]] = float(r["us"])
    wins: dict[tuple[str, str], list[tuple[int, bool]]] = defaultdict(list)
    for (card, shape, m), by_path in sorted(times.items()):
        if "gemm" in by_path:
            wins[card, shape].append((m, by_path["gemm"] <= min(by_path.values())))
    table: dict[str, dict[str, int]] = defaultdict(dict)
    for (card, shape), by_m in wins.items():
        most = FROM_M - 1
        for m, won in by_m:
            if not won:
                break
            most = m
        table[card][shape] = most
    return dict(table)


@functools.cache
def _table() -> dict[str, list[tuple[int, int, int]]]:
    data = json.loads(DATA.read_text()) if DATA.exists() else {}
    return {card: [(*map(int, shape.split(",")), m) for shape, m in shapes.items()]
            for card, shapes in data.items()}


@torch.compiler.assume_constant_result  # torch.compile holds the answer, not the file read
def gemm_max_m(card: str, n: int, k: int) -> int:
    """Up to how many rows the GEMM runs for an [n, k] weight on ``card`` (the nearest
    measured shape's crossover); FROM_M - 1 where nothing was measured."""
    table = _table()
    entries = table.get(card) or next(iter(table.values()), [])
    if not entries:
        return FROM_M - 1
    nearest = min(entries, key=lambda e: math.log(e[0] / n) ** 2 + math.log(e[1] / k) ** 2)
    return nearest[2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qerl.kernels.crossovers",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csvs", nargs="+", type=Path, help="kernel_paths_<card>.csv files")
    parser.add_argument("--out", type=Path, default=DATA)
    args = parser.parse_args(argv)
    rows = [r for path in args.csvs for r in csv.DictReader(path.open())]
    args.out.write_text(json.dumps(from_rows(rows), indent=1) + "\n")
    print(args.out)


if __name__ == "__main__":
    main()
