"""Loads and stores of each storage dtype, converting to and from the accumulator dtype.

float16 and bfloat16 are storage formats only: values are widened to float32 on load and
rounded once on store.  bfloat16 arrays reach the kernels as 16-bit integer views (neither
numba nor the CUDA array interface of torch knows bfloat16); the conversion is done on the
bits, with round-to-nearest-even on store.
"""

from __future__ import annotations

import functools

from numba import float32, float64, int16
from numba.core.types import float16

from .intrinsics import bf16_to_f32, device_function, f32_to_bf16

ACCUMULATOR = {"float16": float32, "bfloat16": float32, "float32": float32, "float64": float64}
"""Storage dtype name -> the numba type the kernels accumulate in."""


@functools.cache
def loader(kind: str, acc_name: str):
    """Device function ``load(a, r, i)``: element ``a[r, i]`` of storage ``kind`` as ``acc``."""
    acc = float64 if acc_name == "float64" else float32
    if kind == "bfloat16":

        def load(a, r, i):
            return acc(bf16_to_f32(a[r, i]))

    else:

        def load(a, r, i):
            return acc(a[r, i])

    return device_function(load)


@functools.cache
def storer(kind: str):
    """Device function ``store(a, r, i, v)``: round ``v`` to storage ``kind`` into ``a[r, i]``."""
    if kind == "bfloat16":

        def store(a, r, i, v):
            a[r, i] = int16(f32_to_bf16(float32(v)))

    else:
        cast = {"float16": float16, "float32": float32, "float64": float64}[kind]

        def store(a, r, i, v):
            a[r, i] = cast(v)

    return device_function(store)
