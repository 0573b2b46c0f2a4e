"""Loads and stores of each storage dtype, converting to and from the accumulator dtype.

float16 and bfloat16 are storage formats only: values are widened to float32 on load and
rounded once on store.  bfloat16 arrays reach the kernels as 16-bit integer views (neither
numba nor the CUDA array interface of torch knows bfloat16); the conversion is done on the
bits, with round-to-nearest-even on store.
"""

from __future__ import annotations

import functools

from numba import float32, float64, int16, int64
from numba.core.types import float16

from .intrinsics import bf16_to_f32, bits_from_f32, device_function, f32_from_bits, f32_to_bf16

ACCUMULATOR = {"float16": float32, "bfloat16": float32, "float32": float32, "float64": float64}
"""Storage dtype name -> the numba type the kernels accumulate in."""


@functools.cache
def loader(kind: str, acc_name: str):
    """Device function ``load(a, i)``: element ``a[i]`` of storage ``kind`` as ``acc``."""
    acc = float64 if acc_name == "float64" else float32
    if kind == "bfloat16":

        def load(a, i):
            return acc(bf16_to_f32(a[i]))

    else:

        def load(a, i):
            return acc(a[i])

    return device_function(load)


@functools.cache
def storer(kind: str):
    """Device function ``store(a, i, v)``: round ``v`` to storage ``kind`` into ``a[i]``."""
    if kind == "bfloat16":

        def store(a, i, v):
            a[i] = int16(f32_to_bf16(float32(v)))

    else:
        cast = {"float16": float16, "float32": float32, "float64": float64}[kind]

        def store(a, i, v):
            a[i] = cast(v)

    return device_function(store)


VECTOR_WIDTH = {"float32": 2, "bfloat16": 4}
"""Values per 8-byte word for the storage dtypes that are loaded and stored as words."""


@functools.cache
def word_io(kind: str, vector: bool):
    """``(width, load_word, store_word)`` for rows of storage ``kind``.

    With ``vector`` (float32 and bfloat16 only), rows are viewed as 8-byte integer words and
    each load or store moves ``width`` values at once (2 float32 or 4 bfloat16): a warp then
    reads 256 consecutive bytes per instruction.  Otherwise a word is one element.
    ``load_word(row, wi, vals, off)`` writes the word's values to ``vals[off:off + width]``
    in the accumulator type; ``store_word(row, wi, vals, off)`` rounds and stores them.
    """
    if vector and kind == "float32":

        def load_word(row, wi, vals, off):
            w = row[wi]
            vals[off] = f32_from_bits(w & 0xFFFFFFFF)
            vals[off + 1] = f32_from_bits((w >> 32) & 0xFFFFFFFF)

        def store_word(row, wi, vals, off):
            lo = int64(bits_from_f32(float32(vals[off])))
            hi = int64(bits_from_f32(float32(vals[off + 1])))
            row[wi] = lo | (hi << 32)

        return 2, device_function(load_word), device_function(store_word)
    if vector and kind == "bfloat16":

        def load_word(row, wi, vals, off):
            w = row[wi]
            vals[off] = f32_from_bits((w << 16) & 0xFFFF0000)
            vals[off + 1] = f32_from_bits(w & 0xFFFF0000)
            vals[off + 2] = f32_from_bits((w >> 16) & 0xFFFF0000)
            vals[off + 3] = f32_from_bits((w >> 32) & 0xFFFF0000)

        def store_word(row, wi, vals, off):
            b0 = int64(f32_to_bf16(float32(vals[off])))
            b1 = int64(f32_to_bf16(float32(vals[off + 1])))
            b2 = int64(f32_to_bf16(float32(vals[off + 2])))
            b3 = int64(f32_to_bf16(float32(vals[off + 3])))
            row[wi] = b0 | (b1 << 16) | (b2 << 32) | (b3 << 48)

        return 4, device_function(load_word), device_function(store_word)
    acc_name = "float64" if kind == "float64" else "float32"
    load = loader(kind, acc_name)
    store = storer(kind)

    def load_one(row, wi, vals, off):
        vals[off] = load(row, wi)

    def store_one(row, wi, vals, off):
        store(row, wi, vals[off])

    return 1, device_function(load_one), device_function(store_one)
