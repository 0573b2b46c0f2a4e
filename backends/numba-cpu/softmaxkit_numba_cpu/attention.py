"""Attention forward as softmaxkit calls it: ``attention(*, xp, q, k, v, ...)``.

Queries are taken in tiles of :data:`TILE_Q`; for each tile only the keys its rows may see
(causal and window limits) are multiplied: ``S = (scale * Q) K^T`` and ``P V`` are BLAS
products through numpy (its threads), and the softmax of the tile is compiled
(:func:`~.attention_kernels.tile_softmax`).  At most ``TILE_Q x Lk`` scores exist at a time,
never ``Lq x Lk``.  float32 and float64; masks and 16-bit dtypes are declined
(:func:`can_run_attention`) and run elsewhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .adapters import empty, numpy_view
from .attention_kernels import key_range, tile_softmax

TILE_Q = 256
"""Queries per tile: large enough for efficient BLAS products, small enough to stay in cache."""


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
    qn, kn, vn = (np.ascontiguousarray(numpy_view(a)) for a in (q, k, v))
    bsz, hq, lq, _ = qn.shape
    hk, lk, dv = kn.shape[1], kn.shape[2], vn.shape[3]
    group = hq // hk
    dtype = qn.dtype
    out, out_s = empty((bsz, hq, lq, dv), q.dtype, q)
    lse_dtype = xp.float64 if dtype == np.float64 else xp.float32
    lse, lse_s = empty((bsz, hq, lq), lse_dtype, q)
    offset = 0 if causal == "top_left" else lk - lq
    left, right = window
    cap = float(softcap) if softcap else 0.0
    buf = np.empty(min(TILE_Q, lq) * lk, dtype=dtype)
    m = np.empty(TILE_Q, dtype=dtype)
    mass = np.empty(TILE_Q, dtype=dtype)
    bad = np.empty(TILE_Q, dtype=np.bool_)
    qs = np.empty((min(TILE_Q, lq), qn.shape[3]), dtype=dtype)
    for b in range(bsz):
        for h in range(hq):
            kh, vh = kn[b, h // group], vn[b, h // group]
            for i0 in range(0, lq, TILE_Q):
                i1 = min(i0 + TILE_Q, lq)
                nq = i1 - i0
                lo, hi = key_range(i0, i1, lk, offset, causal is not None, left, right)
                o = out_s[b, h, i0:i1]
                if hi <= lo:
                    o[...] = 0
                    lse_s[b, h, i0:i1] = -np.inf
                    continue
                s = buf[: nq * (hi - lo)].reshape(nq, hi - lo)
                np.multiply(qn[b, h, i0:i1], dtype.type(scale), out=qs[:nq])
                np.matmul(qs[:nq], kh[lo:hi].T, out=s)
                tile_softmax(s, m, mass, bad, i0, lo, offset, causal is not None, left, right,
                             dtype.type(cap))
                np.matmul(s, vh[lo:hi], out=o)
                ms, ls, bs = m[:nq], mass[:nq], bad[:nq]
                empty_rows = ls == 0
                o /= np.where(empty_rows, 1, ls)[:, None]
                o[empty_rows] = 0
                with np.errstate(divide="ignore"):
                    row_lse = ms + np.log(ls)
                row_lse[empty_rows] = -np.inf
                o[bs] = np.nan
                row_lse[bs] = np.nan
                lse_s[b, h, i0:i1] = row_lse
    return out, (lse if return_lse else None)
