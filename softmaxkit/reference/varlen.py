"""Reference packed variable-length attention: the dense reference attention per sequence.

Each sequence's slices of the packed ``[T, H, D]`` arrays are viewed as one batch
``[1, H, L, D]`` and handed to :func:`~softmaxkit.reference.attention.attention` (and its
gradient), so causal and window alignment, empty rows and grouped-query heads are those of
dense attention by construction.  Layouts are those of :data:`softmaxkit.ops.OPERATIONS`.
"""

from __future__ import annotations

from typing import Any

from ..dtypes import accumulator_dtype
from ..metadata import sequence_spans
from .attention import _device
from .attention import attention as dense
from .attention import attention_vjp as dense_vjp


def _heads_first(xp: Any, a: Any) -> Any:
    """``[L, H, D]`` -> ``[1, H, L, D]``."""
    return xp.permute_dims(a, (1, 0, 2))[None, ...]


def _tokens_first(xp: Any, a: Any) -> Any:
    """``[1, H, L, ...]`` -> ``[L, H, ...]``."""
    return xp.permute_dims(a[0, ...], (1, 0) + tuple(range(2, a.ndim - 1)))


def _concat(xp: Any, parts: list[Any], empty_shape: tuple[int, ...], dtype: Any,
            device: Any) -> Any:
    if not parts:
        return xp.zeros(empty_shape, dtype=dtype, device=device)
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)


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
    """Dense reference attention on each sequence, results packed back along the tokens."""
    dev = _device(q)
    tq, hq, dv = q.shape[0], q.shape[1], v.shape[2]
    acc = accumulator_dtype(xp, q.dtype)
    outs: list[Any] = []
    lses: list[Any] = []
    for q0, q1, k0, k1 in sequence_spans(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue  # no query rows: nothing to compute
        out, lse = dense(
            xp, q=_heads_first(xp, q[q0:q1, ...]), k=_heads_first(xp, k[k0:k1, ...]),
            v=_heads_first(xp, v[k0:k1, ...]), scale=scale, causal=causal, window=window,
            mask=None, softcap=softcap, return_lse=return_lse,
        )
        outs.append(_tokens_first(xp, out))
        if return_lse:
            lses.append(xp.permute_dims(lse[0, ...], (1, 0)))
    out = _concat(xp, outs, (tq, hq, dv), q.dtype, dev)
    if not return_lse:
        return out, None
    return out, _concat(xp, lses, (tq, hq), acc, dev)


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
    """Dense reference gradient on each sequence (the lse's cotangent ``dlse``, where given,
    as in the dense one); keys of a sequence without queries get 0."""
    dev = _device(q)
    tq, hq, d = q.shape
    tk, hk, dv = v.shape
    dqs: list[Any] = []
    dks: list[Any] = []
    dvs: list[Any] = []
    for q0, q1, k0, k1 in sequence_spans(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            # no query reads these keys: their gradient is 0
            dks.append(xp.zeros((k1 - k0, hk, d), dtype=k.dtype, device=dev))
            dvs.append(xp.zeros((k1 - k0, hk, dv), dtype=v.dtype, device=dev))
            continue
        grads = dense_vjp(
            xp, q=_heads_first(xp, q[q0:q1, ...]), k=_heads_first(xp, k[k0:k1, ...]),
            v=_heads_first(xp, v[k0:k1, ...]), out=_heads_first(xp, out[q0:q1, ...]),
            lse=xp.permute_dims(lse[q0:q1, ...], (1, 0))[None, ...],
            dout=_heads_first(xp, dout[q0:q1, ...]), scale=scale, causal=causal,
            window=window, mask=None, softcap=softcap,
            dlse=None if dlse is None else xp.permute_dims(dlse[q0:q1, ...], (1, 0))[None, ...],
        )
        for parts, g in zip((dqs, dks, dvs), grads, strict=True):
            parts.append(_tokens_first(xp, g))
    return (_concat(xp, dqs, (tq, hq, d), q.dtype, dev),
            _concat(xp, dks, (tk, hk, d), k.dtype, dev),
            _concat(xp, dvs, (tk, hk, dv), v.dtype, dev))
