"""The exact float32 forward (kernels/attention_f32.cu) builds for sm_80 and sm_90a with no
register spills, its tiles fit a sm_90 block's shared memory, and its machine code takes no
tensor-core product (counted where cuobjdump is installed): every product is a float32 fma.
Skipped where nvcc is absent."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from softmaxkit_cupy.configs import F32_CONFIGS, all_modules, f32_config, f32_names, f32_shape

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists()
                                else None)
CUOBJDUMP = shutil.which("cuobjdump")

SM90_SHARED = 227 * 1024
"""The most dynamic shared memory a block may take on sm_90."""


def test_every_configuration_fits_sm90() -> None:
    for d, dv in F32_CONFIGS:
        for masked in (True, False):
            config = f32_config(d, dv, masked)
            assert config is not None and config.shared_bytes() <= SM90_SHARED, config


def test_every_pair_of_head_dims_has_a_kernel() -> None:
    # the head dimensions, every step of 8 between, and the latent-attention pair
    for d in range(32, 257, 8):
        assert f32_shape(d, d) is not None, d
        w, wv = f32_shape(d, d)
        assert w >= d and wv >= d and (w == wv or (w, wv) == (d, d))
    assert f32_shape(192, 128) == (192, 128)
    assert f32_shape(8, 24) == (32, 32)
    assert f32_shape(257, 64) is None


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["80", "90a"])
def test_f32_kernels_build_without_spills(
        ptxas: Callable[[str, Sequence[str], str], Any], arch: str) -> None:
    names = f32_names()
    declared = {n for f, ns in all_modules() if f == "attention_f32.cu" for n in ns}
    assert declared == set(names), "every declared instantiation goes through ptxas here"
    build = ptxas("attention_f32.cu", names, f"-gencode=arch=compute_{arch},code=sm_{arch}")
    report = build.report
    assert report.count("Compiling entry function") == len(names)
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert len(spills) == len(names) and set(spills) == {"0"}, report[-3000:]
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert len(registers) == len(names) and max(registers) <= 255, registers
    if CUOBJDUMP is None:
        return
    sass = "".join(subprocess.run([CUOBJDUMP, "-sass", str(cubin)], capture_output=True,
                                  text=True, check=True).stdout for cubin in build.cubins)
    counts: dict[str, int] = {}
    function = ""
    for line in sass.splitlines():
        found = re.search(r"Function : (\S+)", line)
        if found:
            function = found.group(1)
            counts[function] = 0
        else:
            assert "HMMA" not in line and "HGMMA" not in line, line  # no tensor cores
            if re.search(r"\bFFMA\b", line):
                counts[function] += 1
    # a fully unrolled key tile: each lane's 4 rows take 4 (BN / 8) D fma for S = Q K^T
    # and 4 Dv / 8 BN for P V
    for (d, dv), config in F32_CONFIGS.items():
        per_tile = 4 * (config.block_n // 8) * d + 4 * (dv // 8) * config.block_n
        found = [n for f, n in counts.items()
                 if f"ILi{d}ELi{dv}ELi{config.warps}ELi{config.block_n}" in f]
        assert len(found) == 2 and min(found) >= per_tile, (d, dv, found, per_tile)
