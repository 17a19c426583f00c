"""torch.compile of an NVFP4Linear forward on the CPU as on an H100 (stand_in_hopper, fake
CUDA tensors), fullgraph: prints, as JSON, the operators of each M's graph. Run in a process
of its own by test_operators, without Triton's interpreter: an interpreted Triton kernel
cannot be wrapped as an operator, so torch.compile would run it on fake tensors.

    python -m tests.kernels.trace_forward N K M...
"""

from __future__ import annotations

import json
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from qerl.nn import NVFP4Linear
from tests.kernels.conftest import stand_in_hopper


def graph_ops(n: int, k: int, m: int) -> list[str]:
    layer = NVFP4Linear.from_linear(torch.nn.Linear(k, n, bias=False))
    graphs = []

    def record(gm, inputs):
        graphs.append(gm)
        return gm.forward

    with FakeTensorMode(), torch.no_grad():
        for name, t in list(layer.named_buffers()):  # the layer as on a GPU: shapes only
            setattr(layer, name, torch.empty(t.shape, dtype=t.dtype, device="cuda"))
        x = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
        y = torch.compile(layer, backend=record, fullgraph=True, dynamic=False)(x)
    assert len(graphs) == 1 and y.shape == (m, n) and y.dtype == torch.bfloat16
    return [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]


if __name__ == "__main__":
    stand_in_hopper(setattr)
    n, k, *ms = map(int, sys.argv[1:])
    print(json.dumps({m: graph_ops(n, k, m) for m in ms}))
