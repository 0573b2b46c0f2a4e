"""Per-row reductions shared by the row kernels: the row maximum and the shifted sum.

A row is ``x`` (storage, see :mod:`.bits`) with an optional boolean row ``w`` (``False``
excludes a position, exactly like a logit of -inf).  :func:`row_stats` returns the row's kind
and, for an ordinary row, its maximum ``m`` and ``s = sum(exp(x - m))``:

``NORMAL``
    at least one allowed finite logit above -inf, no allowed NaN or +inf;
``NAN``
    an allowed NaN;
``POSINF``
    an allowed +inf and no allowed NaN;
``EMPTY``
    no allowed position above -inf.

The hot path never tests for NaN element by element: the maximum ignores NaN, and the sum of
the shifted logits ``z = x - m`` (computed anyway) is NaN exactly when an allowed logit is
NaN.  Only rows whose maximum is not finite, or whose check sum is NaN, take the slow scalar
classification.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .bits import like, maxnum, put, widen
from .exp import exp_nonpos

NORMAL, NAN, POSINF, EMPTY = 0, 1, 2, 3

FASTMATH = {"reassoc", "contract", "nsz"}
"""Reassociation lets the sums vectorize; NaN and infinities keep their IEEE meaning."""

BLOCK = 1024
"""Block length of the summation: float32 lanes within a block, blocks added in float64."""


@njit(fastmath=FASTMATH, cache=True)
def row_max(x, w, has_where):
    """Maximum of the allowed logits, ignoring NaN (-inf for none).

    ``maxnum`` makes the loop a vectorized reduction: lanewise maxima, one reduction at the end.
    """
    m = like(x, -np.inf)
    if has_where:
        ninf = like(x, -np.inf)
        for j in range(x.shape[0]):
            m = maxnum(m, widen(x[j]) if w[j] else ninf)
    else:
        for j in range(x.shape[0]):
            m = maxnum(m, widen(x[j]))
    return m


@njit(cache=True)
def special_kind(x, w, has_where):
    """Classify a row whose maximum is not finite or whose check sum is NaN (scalar loop)."""
    posinf = False
    for j in range(x.shape[0]):
        if has_where and not w[j]:
            continue
        v = widen(x[j])
        if v != v:
            return NAN
        if v == np.inf:
            posinf = True
    return POSINF if posinf else EMPTY


@njit(fastmath=FASTMATH, cache=True)
def exp_sum(x, w, has_where, m, out, store):
    """``(sum(exp(x - m)), sum(x - m))`` over allowed positions; optionally ``out = exp(x - m)``.

    Blocks of :data:`BLOCK` are summed in the accumulator type (vectorized, so each lane adds
    a few dozen terms) and the block sums are added in float64.
    """
    n = x.shape[0]
    zero = like(m, 0.0)
    ninf = like(m, -np.inf)
    total = 0.0
    chk = zero
    for b0 in range(0, n, BLOCK):
        b1 = min(b0 + BLOCK, n)
        s = zero
        if has_where:
            for j in range(b0, b1):
                allowed = w[j]
                z = widen(x[j]) - m if allowed else ninf
                chk += z if allowed else zero
                e = exp_nonpos(z)
                if store:
                    put(out, j, e)
                s += e
        elif store:
            for j in range(b0, b1):
                z = widen(x[j]) - m
                chk += z
                e = exp_nonpos(z)
                put(out, j, e)
                s += e
        else:
            for j in range(b0, b1):
                z = widen(x[j]) - m
                chk += z
                s += exp_nonpos(z)
        total += s
    return like(m, total), chk


@njit(cache=True)
def row_stats(x, w, has_where, out, store):
    """``(kind, m, s)`` of one row; ``out`` receives ``exp(x - m)`` when ``store`` and NORMAL."""
    m = row_max(x, w, has_where)
    if m - m == m - m:  # finite
        s, chk = exp_sum(x, w, has_where, m, out, store)
        if chk == chk:
            return NORMAL, m, s
        return NAN, m, s
    return special_kind(x, w, has_where), m, like(m, 0.0)
