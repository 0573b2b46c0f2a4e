"""What the host runs of the attention forwards share (tests/test_f32_host.py for
kernels/attention_f32.cu, tests/test_tf32_host.py for kernels/attention_tf32.cu,
tests/test_attention_host.py for the 16-bit kernels/attention.cu): the cases, their inputs,
16-bit values as bits (numpy has no bfloat16), and a launch as the adapters launch a kernel
(softmaxkit_cupy.attention's ``float32_forward`` and ``_attention``), into results that held
NaN.  On ``sys.path`` through the project's pytest ``pythonpath``."""

from __future__ import annotations

from typing import Any

import numpy as np
from softmaxkit_cupy.attention import forward_grid

CASES = [
    dict(b=1, hq=2, hk=2, lq=70, lk=100),
    dict(b=1, hq=2, hk=2, lq=90, lk=90, causal="bottom_right"),
    dict(b=1, hq=4, hk=2, lq=40, lk=111, causal="bottom_right"),  # GQA
    dict(b=2, hq=2, hk=1, lq=100, lk=50, causal="bottom_right"),  # rows with no key
    dict(b=1, hq=2, hk=1, lq=100, lk=50, causal="top_left"),
    dict(b=1, hq=2, hk=2, lq=80, lk=130, window=(30, 10)),
    dict(b=1, hq=2, hk=1, lq=90, lk=90, causal="bottom_right", window=(40, -1), softcap=5.0),
    dict(b=1, hq=2, hk=2, lq=70, lk=97, causal="bottom_right", mask=True),
    dict(b=1, hq=1, hk=1, lq=1, lk=200, mask=True),
]
"""Ragged tiles throughout: causal alignments, grouped queries, rows with no key, windows,
soft caps, boolean masks, a single query row."""


BACKWARD_CASES = [
    dict(b=1, hq=2, hk=2, lq=50, lk=70),
    dict(b=1, hq=4, hk=2, lq=40, lk=75, causal="bottom_right", dlse=True),  # GQA
    dict(b=1, hq=2, hk=1, lq=70, lk=40, causal="bottom_right"),  # rows with no key
    dict(b=1, hq=2, hk=1, lq=60, lk=45, causal="top_left"),
    dict(b=1, hq=2, hk=2, lq=60, lk=60, causal="bottom_right", window=(20, -1), softcap=5.0),
    dict(b=1, hq=2, hk=2, lq=40, lk=55, mask=True, dlse=True),
]
"""Small cases of the kit's ``attention_vjp``: causal alignments, grouped queries with an lse
cotangent, rows with no key, a window with a soft cap, a boolean mask."""


def case_id(c: dict) -> str:
    """A readable test id of a case."""
    return "-".join(f"{k}{v}" for k, v in c.items())


def inputs(d: int, dv: int, case: dict, seed: int):
    """q, k, v (float32, scaled so scores reach a few units) and the mask or None (with a row
    of no allowed key)."""
    rng = np.random.default_rng(seed)
    b, hq, hk, lq, lk = (case[n] for n in ("b", "hq", "hk", "lq", "lk"))
    q = (rng.standard_normal((b, hq, lq, d)) * 1.5).astype(np.float32)
    k = (rng.standard_normal((b, hk, lk, d)) * 1.5).astype(np.float32)
    v = rng.standard_normal((b, hk, lk, dv)).astype(np.float32)
    mask = None
    if case.get("mask"):
        mask = rng.random((b, hq, lq, lk)) > 0.3
        mask[:, :, min(5, lq - 1), :] = False  # a row with no allowed key
    return q, k, v, mask


def options(case: dict) -> dict:
    """The case's causal, window and softcap keywords."""
    return {n: case[n] for n in ("causal", "window", "softcap") if n in case}


def mask_bits(mask: np.ndarray) -> np.ndarray:
    """``mask`` [B, H, Lq, Lk] packed as the kernels read it: bit j % 32 of word j // 32."""
    lk = mask.shape[-1]
    words = max(1, -(-lk // 32))
    padded = np.zeros(mask.shape[:-1] + (words * 32,), dtype=np.uint64)
    padded[..., :lk] = mask
    weights = np.uint64(1) << np.arange(32, dtype=np.uint64)
    packed = (padded.reshape(*mask.shape[:-1], words, 32) * weights).sum(axis=-1)
    return np.ascontiguousarray(packed.astype(np.uint32))


NAN16 = 0x7FFF
"""A NaN in bfloat16 and in float16 alike (all exponent bits set, a nonzero mantissa)."""


def bits16(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` ("bfloat16" or "float16") to nearest, ties to even, as its
    16 bits (uint16, C order): bfloat16 from float32 (``x`` is taken as float32 first: pass
    float32 values to round once), float16 by numpy's cast."""
    if dtype == "float16":
        return np.ascontiguousarray(np.asarray(x).astype(np.float16).view(np.uint16))
    assert dtype == "bfloat16", dtype
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(NAN16), rounded)


def widen16(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values (exact) of 16-bit ``dtype`` values given as their ``bits``."""
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    assert dtype == "bfloat16", dtype
    return (bits.astype(np.uint32) << 16).view(np.float32)


def represented(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (:func:`bits16`), as float32 values: what a 16-bit input
    holds, on which the float64 reference is evaluated."""
    return widen16(bits16(x, dtype), dtype)


def cotangents(out: np.ndarray, lse: np.ndarray, case: dict):
    """Random float32 ``dout`` like ``out`` and, where the case asks (``dlse``), ``dlse``
    like ``lse``, 0 on rows with no allowed key (else None)."""
    rng = np.random.default_rng(3)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dlse = None
    if case.get("dlse"):
        dlse = np.where(lse == -np.inf, 0.0, rng.standard_normal(lse.shape)).astype(np.float32)
    return dout, dlse


def toward_zero(exact: np.ndarray) -> np.ndarray:
    """float64 ``exact`` rounded toward zero to float32 (as the emulated mma rounds its sums)."""
    near = exact.astype(np.float32)
    return np.where(np.abs(near) > np.abs(exact), np.nextafter(near, np.float32(0)), near)


def rounded_by_value(x: np.ndarray, explicit: int, ties_away: bool) -> np.ndarray:
    """Finite float32 ``x`` rounded by value, in float64, to a float of ``explicit`` explicit
    significand bits and float32's exponent range: to the multiple of ``2^(e - explicit - 1)``
    (``2^(e-1) <= |x| < 2^e``; ``2^(-126 - explicit)`` below the normal range) nearest
    ``|x|``, ties away from zero or to even, the sign kept, past the largest float32 inf;
    float32 values."""
    value = x.astype(np.float64)
    _, e = np.frexp(value)
    quantum = np.ldexp(1.0, np.maximum(e - explicit - 1, -126 - explicit))
    scaled = np.abs(value) / quantum
    magnitude = (np.floor(scaled + 0.5) if ties_away else np.rint(scaled)) * quantum
    with np.errstate(over="ignore"):
        return np.copysign(magnitude, value).astype(np.float32)


def address(a: np.ndarray) -> Any:
    """The address of ``a``'s data as a ctypes pointer argument."""
    import ctypes

    return ctypes.c_void_p(a.ctypes.data)


def launch_forward(kernels: dict, name: str, config: Any, q: np.ndarray, k: np.ndarray,
                   v: np.ndarray, mask: np.ndarray | None = None, causal: str | None = None,
                   window: tuple[int, int] | None = None, softcap: float | None = None,
                   dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) of the host kernel ``name`` with ``config``'s grid, threads and shared
    memory, launched as the adapters launch it, into results that held NaN.  With a 16-bit
    ``dtype`` q, k and v are passed rounded to it (:func:`bits16`; pass values it holds to
    compare with a reference on them) and out comes back as float32 values (:func:`widen16`);
    lse is float32 either way."""
    b, hq, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    if dtype == "float32":
        q, k, v = (np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v))
        out = np.full((b, hq, lq, dv), np.nan, dtype=np.float32)
    else:
        q, k, v = (bits16(a, dtype) for a in (q, k, v))
        out = np.full((b, hq, lq, dv), NAN16, dtype=np.uint16)
    lse = np.full((b, hq, lq), np.nan, dtype=np.float32)
    bits, m_strides = None, (0, 0, 0)
    if mask is not None:
        bits = mask_bits(mask)
        m_strides = tuple(s // 4 for s in bits.strides[:3])
    left, right = window if window is not None else (-1, -1)
    options = (d ** -0.5, softcap or 0.0, 0 if causal == "top_left" else lk - lq,
               int(causal is not None), left, right)
    tiles = -(-lq // config.block_m)
    grid, options = (forward_grid(tiles, hq, b, options) if dtype == "float32"  # as launched
                     else ((tiles, hq, b), options))
    args = (q.ctypes.data, k.ctypes.data, v.ctypes.data, 0 if bits is None else bits.ctypes.data,
            out.ctypes.data, lse.ctypes.data,
            *(s // a.itemsize for a in (q, k, v) for s in a.strides[:3]), *m_strides, hq, hk,
            lq, lk, *options)
    kernels[name](grid, config.threads, config.shared_bytes(), *args)
    return (out if dtype == "float32" else widen16(out, dtype)), lse


def move_to_host(monkeypatch: Any, adapter: Any, built: dict, host_kernels: Any) -> None:
    """Move the device boundary of ``adapter`` (a softmaxkit_cupy module with ``_kernel``) to
    the host: ``_kernel`` and ``compiler.function`` name the host builds in ``built`` (the
    mask's packing kernel, kernels/mask_bits.cu, built on first use), ``interop.launch``
    runs them, and ``interop.empty`` gives floating memory filled with NaN, so a result the
    kernels leave unwritten shows."""
    import math

    from softmaxkit_cupy import compiler, interop
    from softmaxkit_cupy.mask_bits import MASK_BITS_PARAMS

    def function(filename: str, names: tuple[str, ...], name: str) -> object:
        if name not in built:
            assert filename == "mask_bits.cu", filename
            built.update(host_kernels(filename, names, MASK_BITS_PARAMS))
        return built[name]

    def launch(kernel, like, grid, block, codes, args, shared=0) -> None:
        grid = (grid, 1, 1) if isinstance(grid, int) else grid
        kernel(grid, block, shared, *args)

    empty, full = interop.empty, interop.full

    def poisoned(like, shape: tuple[int, ...], dtype: str):
        if dtype.startswith(("float", "bfloat")):
            return full(like, shape, math.nan, dtype)
        return empty(like, shape, dtype)

    monkeypatch.setattr(adapter, "_kernel", lambda name: function("", (), name))
    monkeypatch.setattr(compiler, "function", function)
    monkeypatch.setattr(interop, "launch", launch)
    monkeypatch.setattr(interop, "empty", poisoned)
