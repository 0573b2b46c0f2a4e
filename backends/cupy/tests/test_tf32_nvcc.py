"""The float32 TF32 forward and backward (kernels/attention_tf32.cu) build for sm_80 and
sm_90a with no register spills (the forward's alternatives too), within sm_80's shared memory
(the forward: eight warps a multiprocessor on sm_90, and a tile within 99 KB for compute
capability 8.6 and 8.9), and the forward takes one tensor-core product per product of the
definition at "tf32" and three at "tf32x3" (counted in the machine code where cuobjdump is
installed).  Skipped where nvcc is absent."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from softmaxkit_cupy.configs import (
    FITTING_TF32_CONFIGS,
    TF32_BACKWARD_CONFIGS,
    TF32_CONFIGS,
    TF32_PRECISIONS,
    all_modules,
    tf32_alternative_names,
    tf32_backward_config,
    tf32_backward_names,
    tf32_backward_pre_names,
    tf32_config,
    tf32_names,
)

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists()
                                else None)
CUOBJDUMP = shutil.which("cuobjdump") or next(
    (str(p) for p in [Path("/tmp/cuobj/x/nvidia/cu13/bin/cuobjdump")] if p.exists()), None)

SM80_SHARED = 163 * 1024
"""The most dynamic shared memory a block may take on sm_80 (A100)."""
SM90_SHARED = 228 * 1024
"""A sm_90 multiprocessor's shared memory; the system keeps 1 KB of it per block."""
SM86_SHARED = 99 * 1024
"""The most shared memory a block may take on compute capability 8.6, 8.9 and 12.0."""


def test_every_configuration_fits_sm80_and_eight_warps_fit_sm90() -> None:
    for d in TF32_CONFIGS:
        for masked in (True, False):
            config = tf32_config(d, masked)
            assert config.shared_bytes() <= SM80_SHARED, config
            blocks = SM90_SHARED // (config.shared_bytes() + 1024)
            assert blocks * config.warps >= 8, config
            small = tf32_config(d, masked, SM86_SHARED)
            assert small.shared_bytes() <= SM86_SHARED, small
    for d in TF32_BACKWARD_CONFIGS:
        for masked in (True, False):
            config = tf32_backward_config(d, masked)
            assert config.shared_bytes() <= SM80_SHARED, config


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["80", "90a"])
def test_tf32_kernels_build_without_spills(
        ptxas: Callable[[str, Sequence[str], str], Any], arch: str) -> None:
    # the alternatives are timed on the H200 (tools/tf32_timing.py): built for sm_90a only
    alternatives = tf32_alternative_names() if arch == "90a" else ()
    names = (*tf32_names(), *alternatives, *tf32_backward_names(), *tf32_backward_pre_names())
    declared = {n for f, ns in all_modules() if f == "attention_tf32.cu" for n in ns}
    assert declared <= set(names), "every declared instantiation goes through ptxas here"
    build = ptxas("attention_tf32.cu", names, f"-gencode=arch=compute_{arch},code=sm_{arch}")
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
        elif "HMMA" in line:
            assert ".TF32" in line, line  # every tensor-core product takes TF32 operands
            counts[function] = counts.get(function, 0) + 1
    # a fully unrolled key tile: (D / 8) (BN / 8) products for S = Q K^T and as many for P V
    for tile in (*TF32_CONFIGS.values(), *FITTING_TF32_CONFIGS.values()):
        for masked in (True, False):
            config, d = replace(tile, mask=masked), tile.head_dim
            per_tile = 2 * (d // 8) * (config.block_n // 8) * config.m_tiles
            for precision, products in TF32_PRECISIONS.items():
                stage = config.staged and precision == "tf32x3"
                mangled = [f for f in counts
                           if f"ILi{d}ELi{config.warps}ELi{config.block_n}ELi{config.m_tiles}"
                              f"ELb{int(masked)}ELi{products}ELb{int(stage)}EEvPKfS1_S1_PKjPfS4_"
                              "xxxxxxxxxxxxiiiiffiiii" in f]
                assert len(mangled) == 1, (d, masked, precision, sorted(counts))
                assert counts[mangled[0]] == products * per_tile, (mangled, per_tile)
