"""Tests marked ``gpu`` need a CUDA device that CuPy sees; without one they are skipped."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@functools.cache
def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if item.path.is_relative_to(HERE) and item.get_closest_marker("gpu") and not _has_gpu():
            item.add_marker(skip)
