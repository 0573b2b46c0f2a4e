"""The exact float32 forward and backward (kernels/attention_f32.cu) build for sm_80 and
sm_90a with no register spills, their tiles fit a sm_90 block's shared memory (the
backward's two blocks a multiprocessor), and its code (the PTX) takes
no tensor-core product and rounds nothing to TF32: its products are float32 fma.  Skipped
where nvcc is absent."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from softmaxkit_cupy.configs import (
    F32_ALTERNATIVES,
    F32_BACKWARD_ALTERNATIVES,
    F32_BACKWARD_CONFIGS,
    F32_CONFIGS,
    FITTING_F32_CONFIGS,
    WIDE_BACKWARD,
    all_modules,
    f32_alternative_names,
    f32_backward_config,
    f32_backward_names,
    f32_backward_pre_names,
    f32_backward_shape,
    f32_config,
    f32_decode_names,
    f32_names,
    f32_shape,
    f32_varlen_backward_names,
    f32_varlen_names,
)

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists()
                                else None)

SM90_SHARED, SM80_SHARED, SM86_SHARED = 227 * 1024, 163 * 1024, 99 * 1024
"""The most dynamic shared memory a block may take by compute capability (9.0, 8.0, 8.6)."""
SM90_HALF = 228 * 1024 // 2 - 1024
"""Half a sm_90 multiprocessor's shared memory, less the 1 KB the system keeps per block."""


def test_every_configuration_fits_sm90() -> None:
    for d, dv in F32_CONFIGS:
        for masked in (True, False):
            config = f32_config(d, dv, masked)
            assert config is not None and config.shared_bytes() <= SM90_SHARED, config
    for config in (*F32_ALTERNATIVES, *F32_BACKWARD_ALTERNATIVES):
        assert config.shared_bytes() <= SM90_SHARED, config
    for d, dv in F32_BACKWARD_CONFIGS:
        for masked in (True, False):
            config = f32_backward_config(d, dv, masked)
            assert config is not None
            if d <= WIDE_BACKWARD:  # two blocks a multiprocessor
                assert config.shared_bytes() <= SM90_HALF, config
            else:  # one block of eight warps
                assert config.warps == 8 and config.shared_bytes() <= SM90_SHARED, config


def test_the_fitting_tiles_serve_devices_of_less_shared_memory() -> None:
    """The declared tiles wherever they fit a device's blocks; the fitting tiles where not
    (and the manifest's reason, its bytes, where neither fits): 163 KB at compute capability
    8.0, 99 KB at 8.6."""
    from softmaxkit_cupy.manifest import f32_reason

    for (d, dv), smaller in FITTING_F32_CONFIGS.items():
        declared = F32_CONFIGS[(d, dv)]
        assert declared.shared_bytes() > smaller.shared_bytes()
        shapes = ((1, 2, 256, d), (1, 2, 256, d), (1, 2, 256, dv))
        for limit in (SM90_SHARED, SM80_SHARED, SM86_SHARED):
            taken = declared if declared.shared_bytes() <= limit else smaller
            for masked in (True, False):
                assert f32_config(d, dv, masked, limit).name() == replace(
                    taken, mask=masked).name()
            reason = f32_reason(*shapes, limit)
            if taken.shared_bytes() <= limit:
                assert reason is None
            else:
                assert reason is not None and f"takes {taken.shared_bytes()} bytes" in reason
        for masked in (True, False):
            assert f32_config(d, dv, masked).name() == replace(declared, mask=masked).name()
    # compute capability 8.0 takes the declared tiles at 80 and 96 and the fitting ones
    # above; 8.6 takes the fitting tiles at 80 and 96 and declines wider pairs
    for pair in ((80, 96), (96, 96)):
        assert f32_config(*pair, True, SM80_SHARED) == F32_CONFIGS[pair]
        assert f32_config(*pair, True, SM86_SHARED) == FITTING_F32_CONFIGS[pair]
    assert f32_config(128, 128, True, SM80_SHARED) == FITTING_F32_CONFIGS[(128, 128)]
    assert f32_reason((1, 2, 256, 128), (1, 2, 256, 128), (1, 2, 256, 128),
                      SM86_SHARED) is not None


def test_every_pair_of_head_dims_has_a_kernel() -> None:
    # the head dimensions, every step of 8 between, and the latent-attention pair
    for d in range(32, 257, 8):
        assert f32_shape(d, d) is not None, d
        w, wv = f32_shape(d, d)
        assert w >= d and wv >= d and (w, wv) in F32_CONFIGS
    assert f32_shape(192, 128) == (192, 128)
    assert f32_shape(8, 24) == (32, 32)
    assert f32_shape(257, 64) is None


def test_a_call_runs_on_the_pair_of_least_width() -> None:
    # at 80 the forward keeps q and k as they are and pads v alone; the backward pads all three
    assert f32_shape(80, 80) == (80, 96) and f32_backward_shape(80, 80) == (96, 96)
    assert f32_shape(72, 64) == (80, 96) and f32_shape(81, 81) == (96, 96)
    # a narrow value pads to (192, 128), not (192, 192); between equal sums, the square pair
    assert f32_shape(170, 100) == f32_backward_shape(170, 100) == (192, 128)
    assert f32_shape(150, 120) == (160, 160)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["80", "90a"])
def test_f32_kernels_build_without_spills(
        ptxas: Callable[[str, Sequence[str], str], Any], arch: str, tmp_path: Path) -> None:
    # the alternatives are timed on a sm_90 device (tools/tf32_timing.py): built for it only
    names = (*f32_names(), *f32_backward_names(), *f32_backward_pre_names(),
             *f32_varlen_names(), *f32_varlen_backward_names(), *f32_decode_names(),
             *(f32_alternative_names() if arch == "90a" else ()))
    declared = {n for f, ns in all_modules() if f == "attention_f32.cu" for n in ns}
    assert declared <= set(names), "every declared instantiation goes through ptxas here"
    build = ptxas("attention_f32.cu", names, f"-gencode=arch=compute_{arch},code=sm_{arch}")
    report = build.report
    assert report.count("Compiling entry function") == len(names)
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert len(spills) == len(names) and set(spills) == {"0"}, report[-3000:]
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert len(registers) == len(names) and max(registers) <= 255, registers
    ptx = build.ptx
    entries = re.split(r"\.visible \.entry ", ptx)[1:]
    assert len(entries) == len(names)
    for body in entries:
        # float32 products and sums only: no tensor-core product, no rounding to TF32
        assert "mma." not in body and ".tf32" not in body, body.split("(")[0]
        name = body.split("(")[0]
        if "sk_attn_bwd_pre" not in name:  # the row preprocessing: D products
            # decoding: a lane's key against a warp's rows and its share of P V, loops not
            # unrolled in full (a decode is a stream of bytes, not of products)
            assert body.count("fma.rn.f32") >= (64 if "sk_attn_decode" in name else 1024), name
