"""Up to how many rows the Hopper GEMM beats the other paths, per card and weight shape,
read from `qerl bench kernel-paths` (``results/bench/kernel_paths_<card>.csv``).

Decoding a weight once and running cuBLAS costs a decode that grows with N x K plus a BF16
GEMM; the GEMM's own time grows with M. So where it stops winning depends on the shape and
the card, and is measured, not set: ``python -m qerl.kernels.crossovers CSV ...`` writes
what the path sweeps show into ``crossovers.json`` (shipped with the package), and a test
checks that the file is what the committed sweeps give. A shape not measured takes the
crossover of the largest measured weight no larger (else the smallest); a card not
measured, a measured card's (every card with GEMM rows is a Hopper card, the only ones it
runs on).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import functools
import json
from collections import defaultdict
from pathlib import Path

DATA = Path(__file__).with_name("crossovers.json")
# The GEMM is compared from this many rows on; below, the small-M kernels run (CUDA_MAX_M,
# FUSED_MAX_M in nvfp4_matmul, which imports this module: kept equal by a test).
FROM_M = 33


def from_rows(rows: list[dict]) -> dict[str, dict[str, int]]:
    """{card: {N x K: most rows}} from path-sweep rows (forward): a shape's most rows is the
    largest M from FROM_M up to which the GEMM is the fastest path at every measured M
    (FROM_M - 1: it never is)."""
    times: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["op"] == "fwd" and int(r["M"]) >= FROM_M:
            key = (r["card"], int(r["N"]) * int(r["K"]), int(r["M"]))
            times[key][r["path"]] = float(r["us"])
    wins: dict[tuple[str, int], list[tuple[int, bool]]] = defaultdict(list)
    for (card, weights, m), by_path in sorted(times.items()):
        if "gemm" in by_path:
            wins[card, weights].append((m, by_path["gemm"] <= min(by_path.values())))
    table: dict[str, dict[str, int]] = defaultdict(dict)
    for (card, weights), by_m in wins.items():
        most = FROM_M - 1
        for m, won in by_m:
            if not won:
                break
            most = m
        table[card][str(weights)] = most
    return dict(table)


@functools.cache
def _table() -> dict[str, list[tuple[int, int]]]:
    data = json.loads(DATA.read_text()) if DATA.exists() else {}
    return {card: sorted((int(w), m) for w, m in shapes.items()) for card, shapes in data.items()}


def gemm_max_m(card: str, weights: int) -> int:
    """Up to how many rows the GEMM runs for a weight of ``weights`` (N x K) on ``card``;
    FROM_M - 1 where nothing was measured."""
    table = _table()
    entries = table.get(card) or next(iter(table.values()), [])
    if not entries:
        return FROM_M - 1
    at = bisect.bisect_right([w for w, _ in entries], weights) - 1
    return entries[max(at, 0)][1]


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
