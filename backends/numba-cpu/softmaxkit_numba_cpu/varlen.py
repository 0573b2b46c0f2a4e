"""Packed variable-length attention: the backend's dense attention kernels, per sequence.

Sequences of equal lengths ``(Lq, Lk)`` are gathered into one batch ``[G, H, L, D]`` (one
copy, which the kernels' C-contiguous layout needs anyway; a lone sequence is passed as a
transposed view, copied by :func:`.attention.compute_arrays`) and handed to
:func:`.attention.attention` / :func:`.attention.attention_vjp`: one call per distinct pair
of lengths, so a batch of equal lengths is one dense call whose tasks Numba's threads share,
and the compiled kernels, the causal and window bands and the threading decisions are those
of dense attention, with no kernel of its own.  Results are written into packed arrays of the
caller's library.
"""

from __future__ import annotations

from typing import Any

import array_api_compat.numpy as npx
import numpy as np

from softmaxkit.dtypes import accumulator_dtype
from softmaxkit.metadata import Span, sequence_spans

from .adapters import empty, numpy_view
from .attention import attention, attention_vjp


def _groups(cu_q: Any, cu_k: Any) -> list[list[Span]]:
    """The spans ``(q0, q1, k0, k1)`` of the sequences with queries, grouped by their lengths
    ``(q1 - q0, k1 - k0)`` (the frontend has validated the cumulative lengths)."""
    groups: dict[tuple[int, int], list[Span]] = {}
    for span in sequence_spans(cu_q, cu_k):
        if span[1] > span[0]:  # a sequence without queries has nothing to compute
            groups.setdefault((span[1] - span[0], span[3] - span[2]), []).append(span)
    return list(groups.values())


def _batch(a: np.ndarray, spans: list[Span], first: int) -> np.ndarray:
    """The rows of each span (``span[first]:span[first + 1]``) of a packed ``[T, H, D]`` array,
    as one ``[G, H, L, D]`` batch: a view for one span, a copy for several."""
    parts = [a[s[first]:s[first + 1]].transpose(1, 0, 2) for s in spans]
    if len(parts) == 1:
        return parts[0][None]
    # filled part by part: np.stack would keep the parts' transposed layout, and the kernels
    # would need one more copy
    batch = np.empty((len(parts),) + parts[0].shape, dtype=a.dtype)
    for g, part in enumerate(parts):
        batch[g] = part
    return batch


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
    for spans in _groups(cu_seqlens_q, cu_seqlens_k):
        o, s = attention(
            npx, q=_batch(qn, spans, 0), k=_batch(kn, spans, 2), v=_batch(vn, spans, 2),
            scale=scale, causal=causal, window=window, mask=None, softcap=softcap,
            return_lse=True,
        )
        for g, (q0, q1, _, _) in enumerate(spans):
            out_n[q0:q1] = o[g].transpose(1, 0, 2)
            lse_s[q0:q1] = s[g].T
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
    dlse: Any = None,
) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` sequence by sequence (the lse's cotangent ``dlse`` where given, as
    in :func:`~.attention.attention_vjp`); keys of a sequence without queries get 0."""
    qn, kn, vn, on, don = (numpy_view(a) for a in (q, k, v, out, dout))
    lse_n = numpy_view(lse)
    dlse_n = None if dlse is None else numpy_view(dlse)
    grads = [empty(a.shape, x.dtype, q)[0] for a, x in ((qn, q), (kn, k), (vn, v))]
    views = [numpy_view(g) for g in grads]
    for view in views[1:]:
        view[...] = 0  # keys that no query reads keep a zero gradient
    for spans in _groups(cu_seqlens_q, cu_seqlens_k):
        lse_b = _batch(lse_n[..., None], spans, 0)[..., 0]
        parts = attention_vjp(
            npx, q=_batch(qn, spans, 0), k=_batch(kn, spans, 2), v=_batch(vn, spans, 2),
            out=_batch(on, spans, 0), lse=lse_b, dout=_batch(don, spans, 0),
            scale=scale, causal=causal, window=window, mask=None, softcap=softcap,
            dlse=None if dlse_n is None else _batch(dlse_n[..., None], spans, 0)[..., 0],
        )
        for g, (q0, q1, k0, k1) in enumerate(spans):
            for view, part, (lo, hi) in zip(views, parts, ((q0, q1), (k0, k1), (k0, k1)),
                                            strict=True):
                view[lo:hi] = part[g].transpose(1, 0, 2)
    return tuple(grads)
