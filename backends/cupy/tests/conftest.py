"""Tests marked ``gpu`` need a CUDA device that CuPy sees; without one they are skipped.
The fixture ``ptxas`` builds kernel instantiations with nvcc and reads ptxas's report."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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


@dataclasses.dataclass
class PtxasBuild:
    """What :func:`ptxas` built: ptxas's report (``-v``) of every instantiation, and the
    machine code files."""

    report: str
    cubins: list[Path]


@pytest.fixture
def ptxas(tmp_path: Path) -> Callable[[str, Sequence[str], str], PtxasBuild]:
    """Build instantiations ``names`` of kernel source ``filename`` (local includes inlined,
    the text NVRTC compiles) to machine code for ``gencode`` with ptxas's report, split into
    one translation unit per CPU and compiled side by side; fails on a compiler error."""
    nvcc = shutil.which("nvcc") or "/usr/local/bin/nvcc"

    def build(filename: str, names: Sequence[str], gencode: str) -> PtxasBuild:
        from softmaxkit_cupy.compiler import source

        text = source(filename)
        parts = max(1, min(len(names), os.cpu_count() or 1))

        def one(index: int) -> tuple[int, str, Path]:
            unit = tmp_path / f"{filename}.{index}.cu"
            cubin = unit.with_suffix(".cubin")
            unit.write_text(text + "\n" + "\n".join(
                f"void* sk_instance_{i} = (void*)&{name};"
                for i, name in enumerate(names[index::parts])) + "\n")
            done = subprocess.run([nvcc, "-std=c++17", gencode, "-cubin", "-Xptxas", "-v",
                                   str(unit), "-o", str(cubin)], capture_output=True, text=True)
            return done.returncode, done.stderr, cubin

        with ThreadPoolExecutor(max_workers=parts) as pool:
            results = list(pool.map(one, range(parts)))
        failed = [err[-3000:] for rc, err, _ in results if rc != 0]
        assert not failed, "\n".join(failed)
        return PtxasBuild("".join(err for _, err, _ in results), [c for _, _, c in results])

    return build
