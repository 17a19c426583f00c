"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest
import torch

from qerl.kernels import cuda_build
from qerl.kernels import device_facts as facts

H100 = "NVIDIA H100 80GB HBM3"


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the kernels' wrappers allocate starts as NaN: unwritten output fails."""
    real_empty = torch.empty

    def empty(*shape, dtype=None, device=None, **kw):
        t = real_empty(*shape, dtype=dtype, device=device, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


def stand_in_hopper(set_attribute) -> None:
    """An H100's facts without one, each set by ``set_attribute`` (monkeypatch.setattr, or
    setattr in a process of its own): compute capability 9.0, its name (the GEMM's
    crossovers) and SMs, every CUDA kernel building and loading (none is built)."""
    set_attribute(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    set_attribute(cuda_build, "_failure", lambda *build: None)
    set_attribute(facts, "card", lambda device: H100)
    set_attribute(facts, "num_sms", lambda device: 132)


@pytest.fixture
def hopper(monkeypatch):
    """An H100's facts for the test (stand_in_hopper), the kernels' availability asked
    afresh before and after it."""
    cuda_build._unavailable.cache_clear()
    stand_in_hopper(monkeypatch.setattr)
    yield
    cuda_build._unavailable.cache_clear()
