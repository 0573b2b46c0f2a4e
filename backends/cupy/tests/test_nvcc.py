"""Every kernel instantiation the backend can build compiles with nvcc for sm_90 (sm_90a for
the sources that use its instructions, ``configs.SM90_SOURCES``).

The name expressions are the ones the backend hands NVRTC on the device (configs.py) and the
source is the text NVRTC compiles (local includes inlined), so a template error, an
inline-PTX typo or a resource overflow shows up here, on a machine with no GPU.  To fit the
CI budget, instantiations go through the whole device toolchain (PTX and ptxas machine code,
no host compiler) for every bfloat16 row kernel on both targets and for the mma.sync
attention kernels on sm_80, and through the C++ front end and PTX generation for the other
row dtypes, whose inline PTX is the same text as bfloat16's, and for the mma.sync attention
kernels on sm_90: their code is the same for both targets but for ``sk_red_add2``'s vector
reduction, which ptxas takes for sm_90a in test_f32_nvcc.py's float32 backward.  The Hopper
attention sources and the TF32 and exact float32 kernels go through ptxas once, in the tests
that read ptxas's report of them (below, test_tf32_nvcc.py and test_f32_nvcc.py), not again
here.
Skipped only where nvcc is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from softmaxkit_cupy.compiler import source
from softmaxkit_cupy.configs import SM90_SOURCES, all_modules

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists()
                                else None)

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


def _full(filename: str, name: str, arch: str) -> bool:
    """Whether an instantiation goes through ptxas too for ``arch`` (see the module
    docstring)."""
    return (arch == "80" and filename.startswith("attention")) or "<sk_bf16," in name


REPORTED_SOURCES = SM90_SOURCES | {"attention_tf32.cu", "attention_f32.cu"}
"""Sources built, every instantiation through ptxas, by the tests that read ptxas's report
(spills, registers, serialized warpgroup products): compiled there only."""


def _units(workers: int, arch: str) -> list[tuple[str, str, list[str]]]:
    """``(source, mode, names)`` translation units for ``arch``, about two per worker per
    mode, of every source but :data:`REPORTED_SOURCES`."""
    groups: dict[tuple[str, str], list[str]] = {}
    for filename, names in all_modules():
        if filename in REPORTED_SOURCES:
            continue
        for name in names:
            mode = "-cubin" if _full(filename, name, arch) else "-ptx"
            groups.setdefault((filename, mode), []).append(name)
    units = []
    for (filename, mode), names in groups.items():
        names = sorted(set(names))
        parts = min(len(names), workers)
        units += [(filename, mode, names[i::parts]) for i in range(parts)]
    return units


def _compile(tmp: Path, index: int, filename: str, mode: str,
             names: list[str], arch: str | None = None) -> tuple[str, int, str]:
    unit = tmp / f"unit{index}.cu"
    lines = [source(filename)]
    lines += [f"void* sk_instance_{i} = (void*)&{name};" for i, name in enumerate(names)]
    unit.write_text("\n".join(lines) + "\n")
    arch = arch or ("-gencode=arch=compute_90a,code=sm_90a" if filename in SM90_SOURCES
                    else "-arch=sm_90")
    cmd = [NVCC, "-std=c++17", arch, mode, str(unit), "-o", str(tmp / f"unit{index}.o")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return f"{filename} ({mode}, {len(names)} kernels)", done.returncode, done.stderr


def test_every_instantiation_compiles_for_sm90(tmp_path: Path) -> None:
    workers = max(1, os.cpu_count() or 1)
    units = _units(workers, "90")
    assert units, "the backend declares no kernel modules"
    declared = {name for f, names in all_modules() if f not in REPORTED_SOURCES
                for name in names}
    assert {n for _, _, names in units for n in names} == declared
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda iu: _compile(tmp_path, iu[0], *iu[1]), enumerate(units)))
    failures = [(what, err) for what, rc, err in results if rc != 0]
    assert not failures, "\n".join(f"{what}:\n{err[-3000:]}" for what, err in failures)


FALLBACK_SOURCES = ("attention.cu", "attention_bwd.cu", "mask_bits.cu")
"""The attention kernels every GPU other than Hopper runs (mma.sync), and the mask packing."""
ROW_SOURCES = ("rows.cu", "rowgrads.cu")
"""The row kernels, whose cluster kernels build below sm_90 without a cluster shape (never
launched there: configs.row_configs without clusters)."""


def test_kernels_of_other_gpus_compile_for_ampere_and_ada(tmp_path: Path) -> None:
    """The kernels of the other GPUs build for them, ptxas included as in the sm_90 test (an
    instruction or attribute of sm_90 alone, such as a vector reduction or a cluster shape,
    fails here).  sm_80 stands for every target from 8.0 to 8.9: the same instructions, and a
    block's shared memory is sized at launch (configs.attention_shared_bytes), not here."""
    sources = FALLBACK_SOURCES + ROW_SOURCES
    units = [u for u in _units(max(1, os.cpu_count() or 1), "80") if u[0] in sources]
    assert {f for f, _, _ in units} == set(sources)
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        results = list(pool.map(
            lambda iu: _compile(tmp_path, iu[0], *iu[1], "-arch=sm_80"), enumerate(units)))
    failures = [(what, err) for what, rc, err in results if rc != 0]
    assert not failures, "\n".join(f"{what}:\n{err[-3000:]}" for what, err in failures)


def _sm90_units() -> list[tuple[str, list[str]]]:
    from softmaxkit_cupy.configs import (
        ATTENTION_DTYPES,
        SM90_ALTERNATIVES,
        SM90_BACKWARD_ALTERNATIVES,
        sm90_backward_names,
        sm90_names,
        sm90_varlen_backward_names,
        sm90_varlen_names,
    )

    # the forward with its data-path probe, which no module declares (a device check
    # launches it), and the tiles built on request only
    return [("attention_sm90.cu",
             [*sm90_names(), "sk_wgmma_probe<sk_bf16>", "sk_wgmma_probe<__half>",
              *sm90_varlen_names(),
              *(c.name(t) for c in SM90_ALTERNATIVES for t in ATTENTION_DTYPES)]),
            ("attention_bwd_sm90.cu",
             [*sm90_backward_names(), *sm90_varlen_backward_names(),
              *(c.name(t) for c in SM90_BACKWARD_ALTERNATIVES for t in ATTENTION_DTYPES)])]


@pytest.mark.parametrize("filename,names", _sm90_units(), ids=["forward", "backward"])
def test_sm90_attention_keeps_its_registers_and_its_wgmma_pipeline(
        ptxas: Callable[[str, Sequence[str], str], Any], filename: str, names: list[str]) -> None:
    """The Hopper forward's and backward's instantiations spill no registers, and ptxas keeps
    their warpgroup products asynchronous: it serializes them (and says so) when ordinary code
    touches an accumulator between a product's issue and its wait, which would undo the
    overlap of the other work with the tensor cores."""
    declared = {n for f, ns in all_modules() if f == filename for n in ns}
    assert declared <= set(names), "every declared instantiation goes through ptxas here"
    report = ptxas(filename, names, "-gencode=arch=compute_90a,code=sm_90a").report
    assert report.count("Compiling entry function") == len(names)
    assert "serialized" not in report, report[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert len(spills) == len(names) and set(spills) == {"0"}, report[-3000:]
