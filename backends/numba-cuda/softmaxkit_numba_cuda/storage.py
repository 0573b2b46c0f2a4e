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

from .primitives import (
    bf16_to_f32,
    bits_from_f32,
    device_function,
    f32_from_bits,
    f32_to_bf16,
    f64_from_words,
    words_from_f64,
)
from .ptx import load16, pack_bf16, pack_f16, store16, unpack_f16

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


VECTOR_WIDTH = {"float64": 2, "float32": 4, "float16": 8, "bfloat16": 8}
"""Values per 16-byte word for each storage dtype (rows are loaded and stored as words)."""


@functools.cache
def word_io(kind: str, vector: bool):
    """``(width, load_word, store_word)`` for rows of storage ``kind``.

    With ``vector``, each load or store moves one 16-byte word of ``width`` values (4 float32,
    8 bfloat16 or float16, 2 float64), so a warp moves 512 consecutive bytes per instruction;
    the row must be 16-byte aligned and its length a multiple of ``width``.  Otherwise a word
    is one element.  ``load_word(row, wi, vals, off)`` writes word ``wi``'s values to
    ``vals[off:off + width]`` in the accumulator type; ``store_word(row, wi, vals, off)``
    rounds and stores them.  ``row`` is a row of elements (bfloat16 as int16).
    """
    if vector and kind == "float32":

        def load_word(row, wi, vals, off):
            a, b, c, d = load16(row, wi * 4)
            vals[off] = f32_from_bits(a)
            vals[off + 1] = f32_from_bits(b)
            vals[off + 2] = f32_from_bits(c)
            vals[off + 3] = f32_from_bits(d)

        def store_word(row, wi, vals, off):
            store16(row, wi * 4, bits_from_f32(float32(vals[off])),
                    bits_from_f32(float32(vals[off + 1])), bits_from_f32(float32(vals[off + 2])),
                    bits_from_f32(float32(vals[off + 3])))

        return 4, device_function(load_word), device_function(store_word)
    if vector and kind in ("bfloat16", "float16"):
        bf16 = kind == "bfloat16"
        pack = pack_bf16 if bf16 else pack_f16

        def load_word(row, wi, vals, off):
            words = load16(row, wi * 8)
            for k in range(4):
                u = words[k]
                if bf16:  # a bfloat16 is the high half of a float32
                    vals[off + 2 * k] = f32_from_bits(u << 16)
                    vals[off + 2 * k + 1] = f32_from_bits(u & 0xFFFF0000)
                else:
                    lo, hi = unpack_f16(u)
                    vals[off + 2 * k] = lo
                    vals[off + 2 * k + 1] = hi

        def store_word(row, wi, vals, off):
            store16(row, wi * 8, pack(vals[off], vals[off + 1]),
                    pack(vals[off + 2], vals[off + 3]), pack(vals[off + 4], vals[off + 5]),
                    pack(vals[off + 6], vals[off + 7]))

        return 8, device_function(load_word), device_function(store_word)
    if vector and kind == "float64":

        def load_word(row, wi, vals, off):
            a, b, c, d = load16(row, wi * 2)
            vals[off] = f64_from_words(a, b)
            vals[off + 1] = f64_from_words(c, d)

        def store_word(row, wi, vals, off):
            lo0, hi0 = words_from_f64(vals[off])
            lo1, hi1 = words_from_f64(vals[off + 1])
            store16(row, wi * 2, lo0, hi0, lo1, hi1)

        return 2, device_function(load_word), device_function(store_word)
    acc_name = "float64" if kind == "float64" else "float32"
    load = loader(kind, acc_name)
    store = storer(kind)

    def load_one(row, wi, vals, off):
        vals[off] = load(row, wi)

    def store_one(row, wi, vals, off):
        store(row, wi, vals[off])

    return 1, device_function(load_one), device_function(store_one)


@functools.cache
def word_codec(kind: str):
    """``(width, decode, encode)`` for 16-byte words of float32, bfloat16 or float16 held as
    four 32-bit words (a word staged in shared memory): ``decode(a, b, c, d, vals, off)``
    writes the ``width`` values to ``vals[off:off + width]`` as float32; ``encode(vals, off)``
    rounds them and returns the four words."""
    if kind == "float32":

        def decode(a, b, c, d, vals, off):
            vals[off] = f32_from_bits(a)
            vals[off + 1] = f32_from_bits(b)
            vals[off + 2] = f32_from_bits(c)
            vals[off + 3] = f32_from_bits(d)

        def encode(vals, off):
            return (bits_from_f32(float32(vals[off])), bits_from_f32(float32(vals[off + 1])),
                    bits_from_f32(float32(vals[off + 2])),
                    bits_from_f32(float32(vals[off + 3])))

        return 4, device_function(decode), device_function(encode)
    bf16 = kind == "bfloat16"
    pack = pack_bf16 if bf16 else pack_f16

    def half_pair(u, vals, off):
        if bf16:  # a bfloat16 is the high half of a float32
            vals[off] = f32_from_bits(u << 16)
            vals[off + 1] = f32_from_bits(u & 0xFFFF0000)
        else:
            lo, hi = unpack_f16(u)
            vals[off] = lo
            vals[off + 1] = hi

    half_pair = device_function(half_pair)

    def decode(a, b, c, d, vals, off):
        half_pair(a, vals, off)
        half_pair(b, vals, off + 2)
        half_pair(c, vals, off + 4)
        half_pair(d, vals, off + 6)

    def encode(vals, off):
        return (pack(vals[off], vals[off + 1]), pack(vals[off + 2], vals[off + 3]),
                pack(vals[off + 4], vals[off + 5]), pack(vals[off + 6], vals[off + 7]))

    return 8, device_function(decode), device_function(encode)
