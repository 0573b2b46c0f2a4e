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

from softmaxkit_cupy.compiler import KERNELS
from softmaxkit_cupy.configs import all_modules

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists()
                                else None)

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


def _compile(tmp: Path, index: int, filename: str, names: list[str]) -> tuple[str, int, str]:
    unit = tmp / f"unit{index}.cu"
    lines = [f'#include "{filename}"']
    lines += [f"void* sk_instance_{i} = (void*)&{name};" for i, name in enumerate(names)]
    unit.write_text("\n".join(lines) + "\n")
    cmd = [NVCC, "-std=c++17", "-arch=sm_90", f"-I{KERNELS}", "-c", str(unit),
           "-o", str(tmp / f"unit{index}.o")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return filename, done.returncode, done.stderr


def test_every_instantiation_compiles_for_sm90(tmp_path: Path) -> None:
    modules = all_modules()
    assert modules, "the backend declares no kernel modules"
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        results = list(pool.map(lambda im: _compile(tmp_path, im[0], *im[1]),
                                enumerate(modules)))
    failures = [(f, err) for f, rc, err in results if rc != 0]
    assert not failures, "\n".join(f"{f}:\n{err[-3000:]}" for f, err in failures)
