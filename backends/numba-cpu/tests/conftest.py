"""Fixtures shared by the numba-cpu tests."""

from __future__ import annotations

import pytest
from softmaxkit_numba_cpu import attention_grad_kernels, attention_kernels


@pytest.fixture
def small_tiles(monkeypatch):
    """Shrunk attention tiles, so that a few hundred keys cross many tile boundaries."""
    monkeypatch.setattr(attention_kernels, "TILE_Q", 16)
    monkeypatch.setattr(attention_kernels, "TILE_K", 32)
    monkeypatch.setattr(attention_grad_kernels, "TILE_Q", 16)
    monkeypatch.setattr(attention_grad_kernels, "TILE_K", 24)
