"""Every kernel instantiation the backend can build compiles with nvcc for sm_90.

The name expressions are the ones the backend hands NVRTC on the device (configs.py), so a
template error, an inline-PTX typo or a register spill into a compile error shows up here,
on a machine with no GPU.  Skipped only where nvcc is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from softmaxkit_cupy.compiler import source
from softmaxkit_cupy.configs import all_modules

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists()
                                else None)

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


def _compile(tmp: Path, index: int, filename: str, names: list[str]) -> tuple[str, int, str]:
    unit = tmp / f"unit{index}.cu"
    lines = [source(filename)]  # the text NVRTC compiles on the device, includes inlined
    lines += [f"void* sk_instance_{i} = (void*)&{name};" for i, name in enumerate(names)]
    unit.write_text("\n".join(lines) + "\n")
    cmd = [NVCC, "-std=c++17", "-arch=sm_90", "-c", str(unit),
           "-o", str(tmp / f"unit{index}.o")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return filename, done.returncode, done.stderr


def _units(workers: int) -> list[tuple[str, list[str]]]:
    """The instantiations of each source, split into one translation unit per worker."""
    by_source: dict[str, list[str]] = {}
    for filename, names in all_modules():
        by_source.setdefault(filename, []).extend(names)
    units = []
    for filename, names in by_source.items():
        names = sorted(set(names))
        units += [(filename, names[i::workers]) for i in range(min(workers, len(names)))]
    return units


def test_every_instantiation_compiles_for_sm90(tmp_path: Path) -> None:
    workers = max(1, os.cpu_count() or 1)
    modules = _units(workers)
    assert modules, "the backend declares no kernel modules"
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda im: _compile(tmp_path, im[0], *im[1]),
                                enumerate(modules)))
    failures = [(f, err) for f, rc, err in results if rc != 0]
    assert not failures, "\n".join(f"{f}:\n{err[-3000:]}" for f, err in failures)
