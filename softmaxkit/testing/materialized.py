"""Float64 materialized references for attention, its gradient and merges (numpy only).

These form the whole ``[Lq, Lk]`` score matrix on purpose: they are the plain textbook
definition against which the tiled kernels of every backend are checked, and they are used
only on small shapes.
"""

from __future__ import annotations

import math

import numpy as np


def allowed_mask(
    lq: int, lk: int, causal: str | None, window: tuple[int, int] | None
) -> np.ndarray:
    """[Lq, Lk] boolean of the keys each query may see under ``causal`` and ``window``."""
    left, right = window if window is not None else (-1, -1)
    offset = 0 if causal == "top_left" else lk - lq
    i = np.arange(lq)[:, None] + offset
    j = np.arange(lk)[None, :]
    ok = np.ones((lq, lk), dtype=bool)
    if causal is not None:
        ok &= j <= i
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _expand(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    g = q.shape[-3] // k.shape[-3]
    return np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3), g


def _scores(
    q: np.ndarray,
    ke: np.ndarray,
    scale: float,
    causal: str | None,
    window: tuple[int, int] | None,
    mask: np.ndarray | None,
    softcap: float | None,
) -> tuple[np.ndarray, np.ndarray]:
    """(scaled scores, scores soft-capped with the excluded ones at -inf) of float64 queries
    against the keys ``ke`` already repeated over each group of query heads."""
    raw = scale * (q @ np.swapaxes(ke, -1, -2))
    s = softcap * np.tanh(raw / softcap) if softcap else raw
    ok = allowed_mask(q.shape[-2], ke.shape[-2], causal, window)
    if mask is not None:
        ok = ok & mask
    return raw, np.where(np.broadcast_to(ok, s.shape), s, -np.inf)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    scale: float | None = None,
    causal: str | None = None,
    window: tuple[int, int] | None = None,
    mask: np.ndarray | None = None,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(out, natural-log lse) in float64; rows with no allowed key give (0, -inf)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ke, ve, _ = _expand(q, k, v)
    _, s = _scores(q, ke, scale, causal, window, mask, softcap)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    empty = m == -np.inf
    shift = np.where(empty, 0.0, m)
    p = np.exp(s - shift)
    total = p.sum(axis=-1, keepdims=True)
    safe = np.where(empty, 1.0, total)
    out = np.where(empty, 0.0, (p / safe) @ ve)
    lse = np.where(empty, -np.inf, shift + np.log(safe))[..., 0]
    return out, lse


def attention_vjp(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dout: np.ndarray,
    *,
    dlse: np.ndarray | None = None,
    scale: float | None = None,
    causal: str | None = None,
    window: tuple[int, int] | None = None,
    mask: np.ndarray | None = None,
    softcap: float | None = None,
    out: np.ndarray | None = None,
    lse: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq, dk, dv) in float64 by the chain rule through the materialized probabilities;
    ``dlse`` (natural log) is the lse's cotangent, whose score gradient is ``dlse * p``.

    Given a forward's own ``out`` and ``lse`` (both or neither), the probabilities are
    ``exp(S - lse)`` and the row term ``rowsum(dout * out)``, as a backend's backward takes
    them: the exact gradient of that forward, whose error it inherits (spec "Precision")."""
    if (out is None) != (lse is None):
        raise ValueError("out and lse: give a forward's both or neither")
    q, k, v, dout = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ke, ve, g = _expand(q, k, v)
    raw, s = _scores(q, ke, scale, causal, window, mask, softcap)
    if lse is None:
        m = s.max(axis=-1, keepdims=True, initial=-np.inf)
        empty = m == -np.inf
        p = np.exp(s - np.where(empty, 0.0, m))
        p = np.where(empty, 0.0, p / np.where(empty, 1.0, p.sum(-1, keepdims=True)))
    else:
        shift = np.asarray(lse, dtype=np.float64)[..., None]
        p = np.where(shift == -np.inf, 0.0, np.exp(s - np.where(shift == -np.inf, 0.0, shift)))
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(ve, -1, -2)
    if out is None:
        row = (p * dp).sum(-1, keepdims=True)
    else:
        row = (dout * np.asarray(out, dtype=np.float64)).sum(-1, keepdims=True)
    ds = p * (dp - row)
    if dlse is not None:
        ds = ds + p * np.asarray(dlse, dtype=np.float64)[..., None]
    if softcap:
        ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
    ds = ds * scale
    dq = ds @ ke
    dk = np.swapaxes(ds, -1, -2) @ q

    def fold(a: np.ndarray) -> np.ndarray:  # sum each group of query heads onto its kv head
        shape = a.shape[:-3] + (a.shape[-3] // g, g) + a.shape[-2:]
        return a.reshape(shape).sum(axis=-3)

    return dq, fold(dk), fold(dv)


def merge_states(outs: np.ndarray, lses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge partial (out [S, ..., Dv], lse [S, ...]) along axis 0 in float64, by definition."""
    outs, lses = np.asarray(outs, np.float64), np.asarray(lses, np.float64)
    m = lses.max(axis=0)
    empty = m == -np.inf
    w = np.where(lses == -np.inf, 0.0, np.exp(lses - np.where(empty, 0.0, m)))
    total = w.sum(axis=0)
    lse = np.where(empty, -np.inf, np.where(empty, 0.0, m) + np.log(np.where(empty, 1.0, total)))
    a = w / np.where(empty, 1.0, total)
    out = (a[..., None] * np.where((lses == -np.inf)[..., None], 0.0, outs)).sum(axis=0)
    return out, lse


def rel_frobenius(got: np.ndarray, expected: np.ndarray) -> float:
    """``||got - expected||_F / ||expected||_F`` (the absolute norm when ``expected`` is 0)."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    err = float(np.linalg.norm((got - expected).ravel()))
    ref = float(np.linalg.norm(expected.ravel()))
    return err / ref if ref > 0 else err
