"""Compiled part of the attention forward: the online softmax of one tile of scores.

:func:`tile_softmax` receives the scores of a tile of queries against the keys they may see
(``S = (scale * Q) K^T``, a BLAS product made by the caller), applies softcap and the
causal / window limits row by row, and turns each row into ``exp(s - m)`` in place with its
maximum ``m`` and mass ``l``.  The caller multiplies by ``V`` (BLAS) and divides by ``l``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .bits import like, maxnum
from .lanes import FASTMATH, exp_sum


@njit(cache=True, nogil=True)
def key_range(i0, i1, lk, offset, causal, left, right):
    """Keys ``[lo, hi)`` that any query in ``[i0, i1)`` may see (its diagonal is i + offset)."""
    lo = 0
    hi = lk
    if causal or right >= 0:
        reach = 0 if causal else right  # causal: keys up to the diagonal, whatever right is
        hi = min(lk, i1 - 1 + offset + reach + 1)
    if left >= 0:
        lo = max(0, i0 + offset - left)
    return lo, max(lo, hi)


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def tile_softmax(s, p, m, mass, bad, i0, j0, offset, causal, left, right, softcap):
    """Scores ``s`` (queries ``i0 + i``, keys ``j0 + j``) -> ``p = exp(s - m)``, 0 where excluded.

    ``p`` is a separate array: the exponential loop vectorizes only when it does not write the
    array it reads.

    ``m`` and ``mass`` receive each row's maximum and sum (``-inf`` and 0 for a row with no
    allowed key); ``bad`` marks rows with a NaN or +inf score, whose result is NaN (the
    maximum ignores NaN; the sum of ``s - m``, computed anyway, is NaN exactly when a score is).
    """
    nq, nk = s.shape
    ninf = like(s, -np.inf)
    zero = like(s, 0.0)
    for i in range(nq):
        row = s[i]
        prow = p[i]
        diag = i0 + i + offset
        jmin = 0
        jmax = nk
        if causal:
            jmax = min(jmax, diag + 1 - j0)
        elif right >= 0:
            jmax = min(jmax, diag + right + 1 - j0)
        if left >= 0:
            jmin = min(nk, max(0, diag - left - j0))
        jmax = min(nk, max(jmax, jmin))  # allowed keys of this row: [jmin, jmax) of the tile
        if softcap > 0:
            for j in range(jmin, jmax):
                row[j] = softcap * math.tanh(row[j] / softcap)
        mt = ninf
        for j in range(jmin, jmax):
            mt = maxnum(mt, row[j])
        for j in range(jmin):
            prow[j] = zero
        for j in range(jmax, nk):
            prow[j] = zero
        m[i] = mt
        bad[i] = mt == np.inf
        if mt == ninf or mt == np.inf:
            mass[i] = zero
            for j in range(jmin, jmax):
                bad[i] = bad[i] or row[j] != row[j]
                prow[j] = zero
            continue
        # exp(s - m) over the allowed keys; chk is NaN exactly when a score is NaN
        seen = row[jmin:jmax]
        total, chk = exp_sum(seen, seen, False, mt, prow[jmin:jmax], True)
        bad[i] = chk != chk
        mass[i] = total
