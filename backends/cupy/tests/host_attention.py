"""What the host runs of the float32 attention forwards share (tests/test_f32_host.py for
kernels/attention_f32.cu, tests/test_tf32_host.py for kernels/attention_tf32.cu): the cases,
their inputs, and a launch as the adapters launch a kernel (softmaxkit_cupy.attention's
``float32_forward``), into results that held NaN.  On ``sys.path`` through the project's pytest
``pythonpath``."""

from __future__ import annotations

from typing import Any

import numpy as np

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


def launch_forward(kernels: dict, name: str, config: Any, q: np.ndarray, k: np.ndarray,
                   v: np.ndarray, mask: np.ndarray | None = None, causal: str | None = None,
                   window: tuple[int, int] | None = None, softcap: float | None = None,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) of the host kernel ``name`` with ``config``'s grid, threads and shared
    memory, launched as the adapters launch it, into results that held NaN."""
    b, hq, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    q, k, v = (np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v))
    out = np.full((b, hq, lq, dv), np.nan, dtype=np.float32)
    lse = np.full((b, hq, lq), np.nan, dtype=np.float32)
    bits, m_strides = None, (0, 0, 0)
    if mask is not None:
        bits = mask_bits(mask)
        m_strides = tuple(s // 4 for s in bits.strides[:3])
    left, right = window if window is not None else (-1, -1)
    args = (q.ctypes.data, k.ctypes.data, v.ctypes.data, 0 if bits is None else bits.ctypes.data,
            out.ctypes.data, lse.ctypes.data,
            *(s // 4 for a in (q, k, v) for s in a.strides[:3]), *m_strides, hq, hk, lq, lk,
            d ** -0.5, softcap or 0.0, 0 if causal == "top_left" else lk - lq,
            int(causal is not None), left, right)
    kernels[name]((-(-lq // config.block_m), hq, b), config.threads, config.shared_bytes(), *args)
    return out, lse


def move_to_host(monkeypatch: Any, adapter: Any, built: dict, host_kernels: Any) -> None:
    """Move the device boundary of ``adapter`` (a softmaxkit_cupy module with ``_kernel``) to
    the host: ``_kernel`` and ``compiler.function`` name the host builds in ``built`` (the
    mask's packing kernel, kernels/mask_bits.cu, built on first use) and ``interop.launch``
    runs them."""
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

    monkeypatch.setattr(adapter, "_kernel", lambda name: function("", (), name))
    monkeypatch.setattr(compiler, "function", function)
    monkeypatch.setattr(interop, "launch", launch)
