"""Conformance cases for paged attention (decoding and chunked prefill over a paged KV cache).

Each case builds a page pool in which every sequence's pages sit at shuffled places, the
slots past each sequence's end and the unused pages hold NaN, and the unused block-table
entries hold -1 or an index past the pool, so a backend that reads anything it must not gives
NaN or fails.  The result is checked twice: against the float64 materialized definition of
attention on each sequence's gathered keys and values (the represented inputs), under the
bounds of spec/semantics.md, "Attention"; and against ``softmaxkit.attention`` on the same
gathered keys and values in the case's dtype (the default backend), which it must equal up to
both results' rounding.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import softmaxkit as sk

from . import materialized as ref
from .attention_cases import _pair, _square, check_against_dense, check_forward
from .kit import Target, case


def gather(pool: np.ndarray, table: np.ndarray, b: int, n: int) -> np.ndarray:
    """``[H, n, d]``: the first ``n`` keys (or values) of sequence ``b``, from its pages."""
    pages = table[b, : -(-n // pool.shape[2])] if n else table[b, :0]
    dense = np.concatenate([pool[p] for p in pages], axis=1) if len(pages) else (
        np.zeros((pool.shape[1], 0, pool.shape[3]), dtype=pool.dtype))
    return dense[:, :n]


def make_cache(
    rng: np.random.Generator, seqlens: list[int], page_size: int, hk: int, d: int, dv: int,
    spare_pages: int = 2,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(k_pages, v_pages, block_table int32, seqlens int32)`` in float64, NaN where unused.

    The table has one spare column beyond the longest sequence's pages; unused entries are
    -1 or a page index past the pool."""
    need = [-(-n // page_size) for n in seqlens]
    pool = sum(need) + spare_pages
    max_pages = max(need, default=0) + 1
    k_pages = np.full((pool, hk, page_size, d), np.nan)
    v_pages = np.full((pool, hk, page_size, dv), np.nan)
    table = np.where(rng.random((len(seqlens), max_pages)) < 0.5, -1, pool + 3).astype(np.int32)
    order = rng.permutation(pool)
    start = 0
    for b, (n, m) in enumerate(zip(seqlens, need, strict=True)):
        table[b, :m] = order[start:start + m]
        start += m
        for j in range(m):
            keys = min(page_size, n - j * page_size)
            k_pages[table[b, j], :, :keys] = rng.normal(size=(hk, keys, d))
            v_pages[table[b, j], :, :keys] = rng.normal(size=(hk, keys, dv))
    return k_pages, v_pages, table, np.asarray(seqlens, dtype=np.int32)


def paged_definition(
    q: np.ndarray, k_pages: np.ndarray, v_pages: np.ndarray, table: np.ndarray,
    seqlens: Any, causal: Any = None, **kw: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """``(out, lse)`` of the float64 materialized definition on each sequence's gathered keys
    and values, stacked over the sequences; ``causal`` true (``True`` or ``"bottom_right"``)
    aligns bottom-right, as paged attention does."""
    parts = [ref.attention(q[b], gather(k_pages, table, b, n), gather(v_pages, table, b, n),
                           causal="bottom_right" if causal else None, **kw)
             for b, n in enumerate(seqlens)]
    return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])


def _check_paged(
    t: Target, dtype: str, backend: str, seed: int, *, seqlens: list[int], page_size: int,
    hq: int, hk: int, lq: int, d: int, dv: int, causal: bool = False, window: Any = None,
    softcap: Any = None, scale: Any = None, what: str = "paged_attention",
) -> None:
    rng = np.random.default_rng(seed)
    k64, v64, table, lens = make_cache(rng, seqlens, page_size, hk, d, dv)
    b = len(seqlens)
    q, kp, vp = (t.asarray(a, dtype) for a in (rng.normal(size=(b, hq, lq, d)), k64, v64))
    q64, k64, v64 = (t.to_numpy(a) for a in (q, kp, vp))
    kw = {"window": window, "softcap": softcap, "scale": scale}
    got = sk.paged_attention(q, kp, vp, t.asarray(table, None), t.asarray(lens, None),
                             causal=causal, return_lse=True, backend=backend, **kw)
    dense = []
    for i, n in enumerate(seqlens):
        kd, vd = gather(k64, table, i, n), gather(v64, table, i, n)
        o, s = sk.attention(t.asarray(q64[i], dtype), t.asarray(kd, dtype),
                            t.asarray(vd, dtype), causal=causal, return_lse=True, **kw)
        dense.append((t.to_numpy(o), t.to_numpy(s)))
    check_forward(t, dtype, got, paged_definition(q64, k64, v64, table, lens, causal, **kw),
                  what)
    check_against_dense(t, dtype, got, (np.stack([x[0] for x in dense]),
                                        np.stack([x[1] for x in dense])), what)


@case("paged_attention")
def case_paged_attention_decode(t: Target, dtype: str, backend: str) -> None:
    # one query per sequence, a sequence with no key, grouped-query heads, pages of one key
    d, dv = _pair(t)
    for page_size in (1, 4):
        for causal in (False, True):
            _check_paged(t, dtype, backend, 40 + page_size, seqlens=[5, 0, 13, 1, 8],
                         page_size=page_size, hq=4, hk=2, lq=1, d=d, dv=dv, causal=causal,
                         what=f"paged_attention decode page_size={page_size} causal={causal}")


@case("paged_attention")
def case_paged_attention_chunked_prefill(t: Target, dtype: str, backend: str) -> None:
    # Lq new queries per sequence; a sequence shorter than Lq has empty causal rows
    d, dv = _square(t)
    settings: tuple[tuple[dict[str, Any], str], ...] = (
        ({"causal": True}, "causal"),
        ({"causal": False}, "not causal"),
        ({"causal": True, "window": (3, -1)}, "causal window=(3, -1)"),
        ({"window": (2, 1)}, "window=(2, 1)"),
        ({"causal": True, "softcap": 5.0, "scale": 4.0 / math.sqrt(d)}, "causal softcap"),
    )
    for i, (kw, name) in enumerate(settings):
        _check_paged(t, dtype, backend, 50 + i, seqlens=[6, 14, 3, 0, 9], page_size=4, hq=2,
                     hk=1, lq=6, d=d, dv=dv, what=f"paged_attention prefill {name}", **kw)


@case("paged_attention")
def case_paged_attention_long_cache(t: Target, dtype: str, backend: str) -> None:
    # long enough for split-KV kernels to split the cache and merge; the window leaves the
    # first pages out of reach
    d, dv = _square(t)
    for kw, name in (({"causal": True}, "causal"), ({"window": (300, 0)}, "window=(300, 0)")):
        _check_paged(t, dtype, backend, 60, seqlens=[1500, 700, 1100], page_size=16, hq=2,
                     hk=1, lq=2, d=d, dv=dv, what=f"paged_attention long cache {name}", **kw)


@case("paged_attention")
def case_paged_attention_lse_base_2(t: Target, dtype: str, backend: str) -> None:
    d, dv = _square(t)
    rng = np.random.default_rng(70)
    k64, v64, table, lens = make_cache(rng, [7, 0, 12], 4, 2, d, dv)
    q, kp, vp = (t.asarray(a, dtype) for a in (rng.normal(size=(3, 2, 2, d)), k64, v64))
    q64, k64, v64 = (t.to_numpy(a) for a in (q, kp, vp))
    out, lse2 = sk.paged_attention(q, kp, vp, t.asarray(table, None), t.asarray(lens, None),
                                   causal=True, return_lse=True, lse_base=2, backend=backend)
    lse_e = t.asarray(t.to_numpy(lse2) * math.log(2.0), None)
    check_forward(t, dtype, (out, lse_e), paged_definition(q64, k64, v64, table, lens, True),
                  "paged_attention lse_base=2")
