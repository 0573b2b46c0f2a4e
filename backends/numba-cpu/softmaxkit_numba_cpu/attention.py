"""Attention forward as softmaxkit calls it: ``attention(*, xp, q, k, v, ...)``.

Queries are taken in tiles of :data:`TILE_Q`; for each tile only the keys its rows may see
(causal and window limits) are multiplied: ``S = (scale * Q) K^T`` and ``P V`` are BLAS
products through numpy, and the softmax of the tile is compiled
(:func:`~.attention_kernels.tile_softmax`, which releases the GIL).  Large calls give each of
Numba's threads a share of the heads, with BLAS limited to one thread meanwhile
(threadpoolctl), so the two thread pools never nest.  At most ``TILE_Q x Lk`` scores exist
at a time per thread, never ``Lq x Lk``.  float32 and float64 are computed as they are,
float16 and bfloat16 in float32; boolean masks are declined (:func:`~.adapters.can_run`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np

from softmaxkit.dtypes import accumulator_dtype

from .adapters import Output, accumulator, empty, numpy_view
from .attention_kernels import key_range, tile_softmax

TILE_Q = 256
"""Queries per tile: large enough for efficient BLAS products, small enough to stay in cache."""

PARALLEL_MIN_SCORES = 1 << 22
"""Below this many scores (``Lq * Lk * heads``) one thread does all heads."""


def _heads(qn: np.ndarray, kn: np.ndarray, vn: np.ndarray, out: np.ndarray, lse: np.ndarray,
           heads: list[tuple[int, int]], flags: tuple[Any, ...]) -> None:
    """Attention for the (batch, head) pairs ``heads``, written into ``out`` and ``lse``."""
    causal, offset, left, right, cap, scale = flags
    lq, lk = qn.shape[2], kn.shape[2]
    group = qn.shape[1] // kn.shape[1]
    dtype = qn.dtype
    rows = min(TILE_Q, lq)
    buf = np.empty(rows * lk, dtype=dtype)
    pbuf = np.empty(rows * lk, dtype=dtype)
    qs = np.empty((rows, qn.shape[3]), dtype=dtype)
    m = np.empty(TILE_Q, dtype=dtype)
    mass = np.empty(TILE_Q, dtype=dtype)
    bad = np.empty(TILE_Q, dtype=np.bool_)
    for b, h in heads:
        kh, vh = kn[b, h // group], vn[b, h // group]
        for i0 in range(0, lq, TILE_Q):
            i1 = min(i0 + TILE_Q, lq)
            nq = i1 - i0
            lo, hi = key_range(i0, i1, lk, offset, causal, left, right)
            o = out[b, h, i0:i1]
            if hi <= lo:
                o[...] = 0
                lse[b, h, i0:i1] = -np.inf
                continue
            s = buf[: nq * (hi - lo)].reshape(nq, hi - lo)
            p = pbuf[: nq * (hi - lo)].reshape(nq, hi - lo)
            np.multiply(qn[b, h, i0:i1], scale, out=qs[:nq])
            np.matmul(qs[:nq], kh[lo:hi].T, out=s)
            tile_softmax(s, p, m, mass, bad, i0, lo, offset, causal, left, right, cap)
            np.matmul(p, vh[lo:hi], out=o)
            ms, ls, bs = m[:nq], mass[:nq], bad[:nq]
            empty_rows = ls == 0
            o /= np.where(empty_rows, 1, ls)[:, None]
            o[empty_rows] = 0
            with np.errstate(divide="ignore"):
                row_lse = ms + np.log(ls)
            row_lse[empty_rows] = -np.inf
            o[bs] = np.nan
            row_lse[bs] = np.nan
            lse[b, h, i0:i1] = row_lse


def attention(
    xp: Any,
    *,
    q: Any,
    k: Any,
    v: Any,
    scale: float,
    causal: Any,
    window: tuple[int, int],
    mask: Any,
    softcap: Any,
    return_lse: bool,
) -> tuple[Any, Any]:
    """``softmax(scale q k^T) v`` per head, and the log-sum-exp of each row when asked."""
    # 16-bit inputs are computed in float32 (the accumulator) and the output rounded once
    dtype = np.dtype(accumulator(numpy_view(q).dtype))
    qn, kn, vn = (np.ascontiguousarray(numpy_view(a), dtype=dtype) for a in (q, k, v))
    bsz, hq, lq, _ = qn.shape
    lk, dv = kn.shape[2], vn.shape[3]
    result = Output((bsz, hq, lq, dv), q.dtype, q, dtype)
    out_s = result.storage
    lse_dtype = accumulator_dtype(xp, q.dtype)
    lse, lse_s = empty((bsz, hq, lq), lse_dtype, q)
    offset = 0 if causal == "top_left" else lk - lq
    left, right = window
    cap = dtype.type(float(softcap) if softcap else 0.0)
    flags = (causal is not None, offset, left, right, cap, dtype.type(scale))
    heads = [(b, h) for b in range(bsz) for h in range(hq)]
    workers = min(numba.get_num_threads(), len(heads))
    if workers > 1 and lq * lk * len(heads) >= PARALLEL_MIN_SCORES:
        # one head per thread, each with a one-thread BLAS: no nested thread pools
        from threadpoolctl import threadpool_limits

        shares = [heads[i::workers] for i in range(workers)]
        with threadpool_limits(1, user_api="blas"), ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda share: _heads(qn, kn, vn, out_s, lse_s, share, flags), shares))
    else:
        _heads(qn, kn, vn, out_s, lse_s, heads, flags)
    return result.finish(), (lse if return_lse else None)
