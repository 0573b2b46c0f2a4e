"""The conformance kit's attention cases (dense, packed variable-length, paged; forward and
gradient) at every head dimension the GPU kernels are built for, and at a value dimension
unlike the key's, on the CPU backends: the reference (the executable spec) and numba-cpu.

The kit's default head dimensions (softmaxkit.testing.kit.HEAD_DIMS) are small, to keep
simulators fast; these runs hold the CPU backends to the same cases at the sizes users call
the GPU backends with, so a head-dimension-specific fault cannot hide behind the defaults.
numba-cpu runs them in float32 and bfloat16 (its two accumulation paths), the reference in
float64; the kit's default run covers every dtype at the default head dimensions."""

from __future__ import annotations

import pytest

from softmaxkit.testing import Unsupported, cases

OPS = ("attention", "attention_vjp", "varlen_attention", "varlen_attention_vjp",
       "paged_attention")
HEAD_DIMS = ((32, 32), (64, 64), (80, 80), (96, 96), (160, 160), (192, 192), (256, 256),
             (192, 128))
"""The built head dimensions of the cupy attention kernels outside the kit's defaults, and
the (key, value) pair of multi-head latent attention."""


DTYPES = {"reference": ("float64",), "numba-cpu": ("float32", "bfloat16")}


@pytest.mark.parametrize("backend", list(DTYPES))
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"D{d[0]}-Dv{d[1]}")
def test_attention_cases_at_head_dims(backend, dims):
    chosen = cases("numpy", ops=list(OPS), dtypes=DTYPES[backend], head_dims=(dims,))
    assert {op for c in chosen for op in c.ops} >= set(OPS)
    ran = 0
    for case in chosen:
        try:
            case.run(backend)
        except Unsupported:
            continue
        ran += 1
    assert ran == len(chosen), f"{len(chosen) - ran} cases unsupported on {backend}"
