"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest
import torch


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
