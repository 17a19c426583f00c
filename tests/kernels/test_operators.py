"""The CUDA kernels as PyTorch operators (qerl::nvfp4_gemv, qerl::nvfp4_gemm and the Triton
qerl::gemm_tiles). On the CPU, with an H100's facts stood in for and fake CUDA tensors
(trace_forward): torch.compile traces an NVFP4Linear forward, whole (fullgraph), into a
graph that holds the operator of its path. On a GPU (marked): torch.library.opcheck of
each operator on random inputs, and a compiled forward (Inductor) against float64 and the
eager one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qerl.formats import nvfp4
from qerl.kernels import device_facts as facts
from qerl.kernels import nvfp4_gemm as gemm
from qerl.kernels import nvfp4_gemv as gemv
from qerl.kernels import nvfp4_layout as layout
from qerl.kernels import nvfp4_matmul as km
from qerl.nn import NVFP4Linear
from tests.conftest import fresh_seed
from tests.kernels.test_nvfp4_matmul import make, rel_err

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_compiled_forward_holds_the_operator_of_its_path():
    """torch.compile traces an NVFP4Linear forward whole (fullgraph) into one graph holding
    the operator of its path: the CUDA kernel to 32 rows (one member, and above 8 rows the
    shared-x launch), then the Hopper GEMM and its Triton tiling, on an H100's facts."""
    n, k = 4608, 3584  # 7B's q/k/v
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.trace_forward", str(n), str(k),
                           "8", "20", "512"], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).parents[2], check=False, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ops = json.loads(done.stdout.strip().splitlines()[-1])
    assert "qerl.nvfp4_gemv" in ops["8"] and "qerl.nvfp4_gemv" in ops["20"], ops
    assert {"qerl.gemm_tiles", "qerl.nvfp4_gemm"} <= set(ops["512"]), ops


def weights(n_rows: list[int], k: int, dev: str, seed: int, bias: bool):
    """Random NVFP4 weights as the operators take them; the scales as their E4M3 bytes
    (uint8), which the kernels read alike: opcheck compares inputs before and after with
    arithmetic that CUDA lacks for float8."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in n_rows:
        q = nvfp4.quantize(torch.randn(n, k, generator=gen) * 0.05).to(dev)
        b = torch.randn(n, generator=gen).to(torch.bfloat16).to(dev) if bias else None
        out.append((layout.to_pairs(q.packed), q.scale.view(torch.uint8), q.global_scale, b))
    return out


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize(("m", "n_rows", "k", "rank", "dtype"), [
    (1, [4608], 3584, 0, torch.bfloat16),
    (8, [3584, 512, 512], 3584, 32, torch.bfloat16),
    (20, [144, 80], 272, 16, torch.float16),
    (32, [37888], 3584, 0, torch.bfloat16)])
def test_the_small_m_operator_passes_opcheck(m, n_rows, k, rank, dtype):
    seed = fresh_seed()
    ws = weights(n_rows, k, "cuda", seed, bias=True)
    if dtype == torch.float16:
        ws = [(p, s, g, b.half()) for p, s, g, b in ws]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).cuda()
    lora = [torch.randn(rank, k, generator=gen).cuda() for _ in ws] if rank else []
    assert gemv.available(x.device), gemv.unavailable_reason(x.device)
    splits, k_warps = gemv.launch_shape(m, n_rows, k, facts.num_sms(x.device), rank)
    torch.library.opcheck(torch.ops.qerl.nvfp4_gemv.default,
                          (x, [w[0] for w in ws], [w[1] for w in ws], [w[2] for w in ws],
                           [w[3] for w in ws], splits, k_warps, lora))


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize(("m", "n_rows", "k"), [(64, [3584], 3584), (300, [4096, 512, 512], 3584),
                                                (2048, [37888], 3584)])
def test_the_hopper_gemm_operators_pass_opcheck(m, n_rows, k):
    if not gemm.available(torch.device("cuda")):
        pytest.skip(gemm.unavailable_reason(torch.device("cuda")))
    seed = fresh_seed()
    ws = weights(n_rows, k, "cuda", seed, bias=False)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()
    launch = gemm.launch_for(m, sum(n_rows), k, facts.num_sms(x.device))
    quads, rows = ws[0][0].shape[1], -(-m // launch.token_tile) * launch.token_tile
    ready = torch.zeros(2 * launch.blocks, dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.qerl.gemm_tiles.default, (x, quads, rows, ready))
    xg = gemm.gemm_tiles(x, quads, rows, ready)
    torch.library.opcheck(torch.ops.qerl.nvfp4_gemm.default,
                          (xg, ready, [w[0] for w in ws], [w[1] for w in ws],
                           [w[2] for w in ws], [w[3] for w in ws], m, launch.token_tile,
                           launch.blocks))


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("m", [1, 8, 20, 64, 512, 2048])
def test_a_forward_compiled_by_inductor_is_the_eager_one(m):
    """Inductor's graph runs the operators as eager code does: against float64 to the
    kernels' tolerance, and equal to the eager result (the reduction of split-K partials,
    which Inductor may fuse, to one bf16 rounding)."""
    n, k = 4608, 3584
    seed = fresh_seed()
    q, (pairs, scale, _), x, bias, _ = make(n, k, (m,), torch.bfloat16, seed, "cuda")
    layer = NVFP4Linear(q, bias)
    with torch.no_grad():
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)(x)
        eager = layer(x)
    ref = x.double() @ nvfp4.dequantize(q, torch.float64).T + bias.double()
    assert rel_err(compiled, ref) < 8e-3, f"seed {seed}"
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)
    if km.forward_path(x, pairs, scale) == "gemm":
        assert torch.equal(compiled, eager), f"seed {seed}"
