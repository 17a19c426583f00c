"""Where the Hopper GEMM hands over to decode + cuBLAS: derived from path sweeps, shipped
as crossovers.json, which must be what the committed sweeps give."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from qerl.kernels import crossovers
from qerl.kernels import nvfp4_matmul as km

RESULTS = Path(__file__).parents[2] / "results" / "bench"


def rows(card: str, n: int, k: int, times: dict[int, dict[str, float]], op: str = "fwd"):
    return [{"card": card, "op": op, "M": m, "N": n, "K": k, "path": path, "us": us}
            for m, by_path in times.items() for path, us in by_path.items()]


def test_the_shipped_crossovers_are_what_the_committed_sweeps_give():
    sweeps = [r for path in sorted(RESULTS.glob("kernel_paths_*.csv"))
              for r in csv.DictReader(path.open())]
    assert json.loads(crossovers.DATA.read_text()) == crossovers.from_rows(sweeps), (
        "rerun: python -m qerl.kernels.crossovers results/bench/kernel_paths_*.csv")


def test_a_shape_wins_up_to_its_first_loss():
    sweep = rows("card", 100, 128, {16: {"cuda": 1.0, "gemm": 9.0},  # small M: not compared
                                    48: {"gemm": 1.0, "dequant": 2.0},
                                    64: {"gemm": 1.0, "dequant": 1.0},  # a tie goes to it
                                    96: {"gemm": 3.0, "dequant": 2.0},
                                    128: {"gemm": 1.0, "dequant": 2.0}})
    sweep += rows("card", 100, 128, {48: {"triton": 0.1}}, op="bwd")  # not the forward
    sweep += rows("card", 200, 128, {48: {"gemm": 5.0, "dequant": 2.0}})
    assert crossovers.from_rows(sweep) == {"card": {"100,128": 64, "200,128": 32}}


def test_lookup_by_the_nearest_measured_shape_and_card(monkeypatch):
    """A wide and a narrow weight of one size are told apart (a 14B gate_up is not a 32B
    down)."""
    table = {"A": [(37888, 3584, 512), (5120, 27648, 256), (3584, 3584, 64)], "B": [(1, 1, 99)]}
    monkeypatch.setattr(crossovers, "_table", lambda: table)
    assert crossovers.gemm_max_m("A", 27648, 5120) == 512  # nearest: the wide gate_up
    assert crossovers.gemm_max_m("A", 5120, 13824) == 256
    assert crossovers.gemm_max_m("A", 3584, 3584) == 64
    assert crossovers.gemm_max_m("unmeasured", 3584, 3584) == 64  # a measured card's
    monkeypatch.setattr(crossovers, "_table", lambda: {})
    assert crossovers.gemm_max_m("A", 3584, 3584) == crossovers.FROM_M - 1


def test_the_gemm_is_compared_where_the_small_m_kernels_stop():
    assert crossovers.FROM_M == km.FUSED_MAX_M + 1 == km.CUDA_MAX_M + 1


def test_the_command_writes_the_table(tmp_path):
    sweep = tmp_path / "kernel_paths_card.csv"
    fields = ["card", "op", "M", "N", "K", "path", "us"]
    with sweep.open("w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        w.writerows(rows("card", 100, 128, {48: {"gemm": 1.0, "dequant": 2.0}}))
    crossovers.main([str(sweep), "--out", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text()) == {"card": {"100,128": 48}}
