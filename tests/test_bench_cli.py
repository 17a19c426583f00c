"""GPU-only benchmarks say so on a machine without one, instead of timing the CPU."""

from __future__ import annotations

import pytest
import torch

from qerl.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
@pytest.mark.parametrize("what", ["kernels", "kernel-paths", "memory", "rollout",
                                  "decode-step"])
def test_gpu_benchmarks_name_the_missing_gpu(what):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["bench", what])
