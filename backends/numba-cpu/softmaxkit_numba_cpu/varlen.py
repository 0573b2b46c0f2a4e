"""Packed variable-length attention: the backend's attention kernels run once per sequence.

Each sequence's rows of the packed ``[T, H, D]`` arrays are viewed as one batch
``[1, H, L, D]`` (a transposed view; :func:`.attention.compute_arrays` makes the
C-contiguous copy in the accumulator dtype that the kernels read anyway) and handed to
:func:`.attention.attention` / :func:`.attention.attention_vjp`, so the compiled kernels, the
causal and window bands and the threading decisions are those of dense attention, with no
kernel of its own.  Results are written into packed arrays of the caller's library.
"""

from __future__ import annotations

from typing import Any

import array_api_compat.numpy as npx
import numpy as np

from softmaxkit.dtypes import accumulator_dtype

from .adapters import empty, numpy_view
from .attention import attention, attention_vjp


def _sequences(cu_q: Any, cu_k: Any) -> list[tuple[int, int, int, int]]:
    """``(q0, q1, k0, k1)`` of each sequence (the frontend has validated the lengths)."""
    hq, hk = numpy_view(cu_q).tolist(), numpy_view(cu_k).tolist()
    return [(hq[b], hq[b + 1], hk[b], hk[b + 1]) for b in range(len(hq) - 1)]


def _batch(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Rows ``lo:hi`` of a packed ``[T, H, D]`` array as a ``[1, H, L, D]`` view."""
    return a[lo:hi].transpose(1, 0, 2)[None]


def varlen_attention(
    xp: Any,
    *,
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    scale: float,
    causal: Any,
    window: tuple[int, int],
    softcap: Any,
    return_lse: bool,
) -> tuple[Any, Any]:
    """Attention of each packed sequence with its own keys; out 0 and lse -inf when empty."""
    qn, kn, vn = (numpy_view(a) for a in (q, k, v))
    tq, hq = qn.shape[:2]
    out, out_s = empty((tq, hq, vn.shape[2]), q.dtype, q)
    lse, lse_s = empty((tq, hq), accumulator_dtype(xp, q.dtype), q)
    out_n = numpy_view(out)
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        o, s = attention(
            npx, q=_batch(qn, q0, q1), k=_batch(kn, k0, k1), v=_batch(vn, k0, k1),
            scale=scale, causal=causal, window=window, mask=None, softcap=softcap,
            return_lse=True,
        )
        out_n[q0:q1] = o[0].transpose(1, 0, 2)
        lse_s[q0:q1] = s[0].T
    return out, (lse if return_lse else None)


def varlen_attention_vjp(
    xp: Any,
    *,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dout: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    scale: float,
    causal: Any,
    window: tuple[int, int],
    softcap: Any,
) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` sequence by sequence; keys of a sequence without queries get 0."""
    qn, kn, vn, on, don = (numpy_view(a) for a in (q, k, v, out, dout))
    lse_n = numpy_view(lse)
    grads = [empty(a.shape, x.dtype, q)[0] for a, x in ((qn, q), (kn, k), (vn, v))]
    views = [numpy_view(g) for g in grads]
    for view in views[1:]:
        view[...] = 0  # keys that no query reads keep a zero gradient
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        parts = attention_vjp(
            npx, q=_batch(qn, q0, q1), k=_batch(kn, k0, k1), v=_batch(vn, k0, k1),
            out=_batch(on, q0, q1), lse=lse_n[q0:q1].T[None], dout=_batch(don, q0, q1),
            scale=scale, causal=causal, window=window, mask=None, softcap=softcap,
        )
        for view, part, (lo, hi) in zip(views, parts, ((q0, q1), (k0, k1), (k0, k1)),
                                        strict=True):
            view[lo:hi] = part[0].transpose(1, 0, 2)
    return tuple(grads)
