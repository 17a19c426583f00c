"""Every launch configuration compiles for Hopper (sm_90) within its shared memory, runs on
tensor cores, loads the packed weight in 16-byte vectors and does not spill; and compiles
for the cards before Hopper (an A100, an RTX 3090 or 4090: what QERL_KERNEL_ARCH makes a
Hopper card choose, but cannot compile for them), as do the fp8 KV cache's write and
decode attention: checked on the CPU, before any GPU time is spent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Largest dynamic shared memory per block (the CUDA programming guide's per-architecture
# limits): A100 163 KiB, RTX 30x0 and 40x0 99 KiB, H100/H200 227 KiB.
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def compiled(*archs: int | str) -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    script = Path(__file__).with_name("compile_kernels.py")
    done = subprocess.run([sys.executable, str(script), *map(str, archs)], env=env,
                          capture_output=True, text=True, check=False,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_all_launch_configs_compile_for_hopper():
    results = [r for r in compiled(90) if r["op"] != "dequant"]
    assert len(results) >= 8
    for r in results:
        assert r["shared"] <= MAX_SHARED[90], r
        assert r["mma"] > 0, r
        # Single-byte loads of the packed weight waste bandwidth (seen on an H200):
        # codes come in 16-byte copies, and only the fp8 scales (two per chunk, in the loop
        # and its pipelined prologue) are single bytes; byte-wise codes would be 16 a chunk.
        assert r["wide_async_loads"] > 0, r
        assert r["byte_loads"] < 16, r
        # A few spill instructions are harmless (the fp16 backward at 32 rows keeps three
        # 64-bit addresses in local memory: 3 stores before its loop, 3 L1 loads in it);
        # many mean a tile too big.
        assert r["spills"] <= 6, r


@pytest.mark.slow
def test_every_kernel_compiles_for_the_cards_before_hopper():
    """Before sm_89 Triton has no fp8 type, and before sm_90 no packed bf16 multiply: the
    kernels read the scales' bits and multiply by an fma there (compute_capability)."""
    results = compiled(80, 86, 89)
    assert {(r["arch"], r["op"], r["dtype"]) for r in results} == {
        (a, op, d) for a in (80, 86, 89) for op in ("fwd", "bwd", "dequant")
        for d in ("bf16", "fp16")}
    for r in results:
        assert r["shared"] <= MAX_SHARED[r["arch"]], r
        assert r["spills"] <= 6, r
        assert (r["mma"] > 0) == (r["op"] != "dequant"), r


@pytest.mark.slow
def test_the_fp8_cache_kernels_compile_for_every_card():
    """The cache write (E4M3 from its bits) and decode attention over an fp8 cache (read
    by the fp8 conversion from sm_89, from the bits before) compile from the A100 on,
    within shared memory and without spills."""
    results = compiled("cache", 80, 86, 89, 90)
    assert {(r["arch"], r["op"], r["dtype"]) for r in results} == {
        (a, op, d) for a in (80, 86, 89, 90) for d in ("bf16", "fp16")
        for op in ("decode_split_kernel", "rotary_cache_kernel")}
    for r in results:
        assert r["shared"] <= MAX_SHARED[r["arch"]], r
        assert r["spills"] == 0, r
