"""Compiled row kernels: one function per row and operation, and the loops over rows.

Every ``*_row`` function follows softmaxkit/reference/rows.py (the executable spec) for one
row; the special rows (:mod:`.lanes`) are written out explicitly so no ``-inf - (-inf)`` or
``inf / inf`` is ever evaluated.  Each operation has two drivers over rows with one body:
``*_par`` (``prange``, threads as Numba is set) and ``*_ser`` (one thread, for inputs too small
to repay starting the threads).  Arrays are 2-D C-contiguous storage views (:mod:`.bits`);
a mask ``w`` is a 2-D boolean array whose row ``i * wstep`` belongs to row ``i`` (``wstep`` is
0 for a mask shared by all rows).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .bits import like, put, widen
from .exp import exp_nonpos
from .lanes import EMPTY, FASTMATH, NAN, NORMAL, POSINF, row_stats


@njit(cache=True)
def _fill(out, value):
    for j in range(out.shape[0]):
        put(out, j, value)


# -- softmax ---------------------------------------------------------------------------------


@njit(fastmath=FASTMATH, cache=True)
def softmax_row(x, w, has_where, masked_nan, exact, out):
    """exp(x - m) / s; ``exact``: ``out`` holds the accumulator (store, then scale in place)."""
    kind, m, s = row_stats(x, w, has_where, out, exact)
    nan = like(m, np.nan)
    if kind == NORMAL:
        inv = like(m, 1.0) / s
        if exact:
            for j in range(x.shape[0]):
                put(out, j, widen(out[j]) * inv)
        elif has_where:
            for j in range(x.shape[0]):
                put(out, j, exp_nonpos(widen(x[j]) - m) * inv if w[j] else like(m, 0.0))
        else:
            for j in range(x.shape[0]):
                put(out, j, exp_nonpos(widen(x[j]) - m) * inv)
    elif kind == EMPTY and not masked_nan:
        _fill(out, like(m, 0.0))
    else:
        _fill(out, nan)


@njit(parallel=True, cache=True)
def softmax_par(x, w, wstep, has_where, masked_nan, exact, out):
    for i in prange(x.shape[0]):
        softmax_row(x[i], w[i * wstep], has_where, masked_nan, exact, out[i])


@njit(cache=True)
def softmax_ser(x, w, wstep, has_where, masked_nan, exact, out):
    for i in range(x.shape[0]):
        softmax_row(x[i], w[i * wstep], has_where, masked_nan, exact, out[i])


# -- log_softmax -----------------------------------------------------------------------------


@njit(fastmath=FASTMATH, cache=True)
def log_softmax_row(x, w, has_where, masked_nan, out):
    """(x - m) - log(s); excluded positions -inf."""
    kind, m, s = row_stats(x, w, has_where, out, False)
    ninf = like(m, -np.inf)
    nan = like(m, np.nan)
    if kind == NORMAL:
        ls = like(m, math.log(s))
        if has_where:
            for j in range(x.shape[0]):
                put(out, j, (widen(x[j]) - m) - ls if w[j] else ninf)
        else:
            for j in range(x.shape[0]):
                put(out, j, (widen(x[j]) - m) - ls)
    elif kind == POSINF:
        inf = like(m, np.inf)
        for j in range(x.shape[0]):
            allowed = not has_where or w[j]
            put(out, j, nan if allowed and widen(x[j]) == inf else ninf)
    elif kind == EMPTY and not masked_nan:
        _fill(out, ninf)
    else:
        _fill(out, nan)


@njit(parallel=True, cache=True)
def log_softmax_par(x, w, wstep, has_where, masked_nan, out):
    for i in prange(x.shape[0]):
        log_softmax_row(x[i], w[i * wstep], has_where, masked_nan, out[i])


@njit(cache=True)
def log_softmax_ser(x, w, wstep, has_where, masked_nan, out):
    for i in range(x.shape[0]):
        log_softmax_row(x[i], w[i * wstep], has_where, masked_nan, out[i])


# -- logsumexp -------------------------------------------------------------------------------


@njit(fastmath=FASTMATH, cache=True)
def logsumexp_row(x, w, has_where):
    """``(lse, sign)`` of one row without weights."""
    kind, m, s = row_stats(x, w, has_where, x, False)
    if kind == NORMAL:
        return m + like(m, math.log(s)), like(m, 1.0)
    if kind == NAN:
        return like(m, np.nan), like(m, np.nan)
    if kind == POSINF:
        return like(m, np.inf), like(m, 1.0)
    return like(m, -np.inf), like(m, 0.0)


@njit(parallel=True, cache=True)
def logsumexp_par(x, w, wstep, has_where, lse, sign):
    for i in prange(x.shape[0]):
        value, sg = logsumexp_row(x[i], w[i * wstep], has_where)
        put(lse, i, value)
        put(sign, i, sg)


@njit(cache=True)
def logsumexp_ser(x, w, wstep, has_where, lse, sign):
    for i in range(x.shape[0]):
        value, sg = logsumexp_row(x[i], w[i * wstep], has_where)
        put(lse, i, value)
        put(sign, i, sg)


@njit(cache=True)
def logsumexp_b_row(x, b, w, has_where, return_sign):
    """``(lse, sign)`` of ``log |sum b exp(x)|``; ``b == 0`` excludes a position (as SciPy).

    Scalar code: the weighted form is off the fast path.  As in the reference, a +inf row
    sums the weights standing at +inf logits, and a NaN weight anywhere makes the row NaN.
    """
    n = x.shape[0]
    m = like(b, -np.inf)
    has_nan = False
    posinf = False
    nan_b = False
    for j in range(n):
        bj = b[j]
        if bj != bj:
            nan_b = True
        if (has_where and not w[j]) or bj == 0:
            continue
        v = widen(x[j])
        if v != v:
            has_nan = True
        elif v == np.inf:
            posinf = True
        elif v > m:
            m = v
    zero = like(b, 0.0)
    total = 0.0
    shift = zero
    if has_nan:
        kind = NAN
    elif posinf:
        kind = POSINF
        for j in range(n):
            if widen(x[j]) == np.inf:
                total += b[j]
    elif m == -np.inf:
        kind = EMPTY
        for j in range(n):
            total += zero * b[j]
    else:
        kind = NORMAL
        shift = m
        for j in range(n):
            bj = b[j]
            allowed = not (has_where and not w[j]) and bj != 0
            e = exp_nonpos(widen(x[j]) - m) if allowed else zero
            total += e * bj
    t = like(b, total)
    if nan_b:
        t = like(b, np.nan)
    sign = like(b, np.nan) if t != t else (like(b, 1.0) if t > 0 else (
        like(b, -1.0) if t < 0 else zero))
    mag = abs(t)
    if mag == 0:
        lse = like(b, -np.inf)
    else:
        lse = like(b, math.log(mag)) + shift
        if kind == POSINF:
            lse = like(b, np.inf)
    if kind == NAN:
        lse = like(b, np.nan)
        sign = like(b, np.nan)
    if not return_sign and sign < 0:
        lse = like(b, np.nan)
    return lse, sign


@njit(cache=True)
def logsumexp_b_ser(x, b, w, wstep, has_where, return_sign, lse, sign):
    for i in range(x.shape[0]):
        value, sg = logsumexp_b_row(x[i], b[i], w[i * wstep], has_where, return_sign)
        put(lse, i, value)
        put(sign, i, sg)


# -- cross entropy ---------------------------------------------------------------------------


@njit(fastmath=FASTMATH, cache=True)
def cross_entropy_row(x, w, has_where, target, probs, has_index, eps, valid, scale, want_grad,
                      grad):
    """Loss ``-sum_{y != 0} y log p`` and, if ``want_grad``, ``grad = scale * (p - y)``.

    ``y`` is the one-hot of ``target`` (``has_index``) or ``probs``, smoothed by ``eps`` over
    the allowed positions.
    """
    n = x.shape[0]
    kind, m, s = row_stats(x, w, has_where, x, False)
    zero = like(m, 0.0)
    one = like(m, 1.0)
    ninf = like(m, -np.inf)
    nan = like(m, np.nan)
    count = n
    if has_where:
        count = 0
        for j in range(n):
            count += 1 if w[j] else 0
    share = eps / like(m, count if count else 1)
    keep = one - eps
    ls = like(m, math.log(s)) if kind == NORMAL else zero
    loss = 0.0
    for j in range(n):
        allowed = not has_where or w[j]
        y = (one if j == target else zero) if has_index else probs[j]
        if eps != 0:
            y = keep * y + (share if allowed else zero)
        if y != 0:
            if kind == NORMAL:
                logp = (widen(x[j]) - m) - ls if allowed else ninf
            elif kind == EMPTY:
                logp = ninf
            else:
                logp = zero
            loss -= y * logp
    out = like(m, loss)
    if kind == NAN or kind == POSINF:
        out = nan
    if not valid:
        out = zero
    if want_grad:
        inv = one / s if kind == NORMAL else zero
        for j in range(n):
            allowed = not has_where or w[j]
            y = (one if j == target else zero) if has_index else probs[j]
            if eps != 0:
                y = keep * y + (share if allowed else zero)
            if kind == NORMAL:
                p = exp_nonpos(widen(x[j]) - m) * inv if allowed else zero
            elif kind == EMPTY:
                p = zero
            else:
                p = nan
            put(grad, j, (p - y) * scale if valid else zero)
    return out


@njit(cache=True)
def cross_entropy_ser(x, w, wstep, has_where, target, probs, pstep, has_index, eps,
                      ignore, has_ignore, scale, want_grad, loss, grad, gstep):
    for i in range(x.shape[0]):
        t = target[i] if has_index else -1
        valid = not (has_index and has_ignore and t == ignore)
        loss[i] = cross_entropy_row(x[i], w[i * wstep], has_where, t, probs[i * pstep],
                                    has_index, eps, valid, scale, want_grad, grad[i * gstep])


@njit(parallel=True, cache=True)
def cross_entropy_par(x, w, wstep, has_where, target, probs, pstep, has_index, eps,
                      ignore, has_ignore, scale, want_grad, loss, grad, gstep):
    for i in prange(x.shape[0]):
        t = target[i] if has_index else -1
        valid = not (has_index and has_ignore and t == ignore)
        loss[i] = cross_entropy_row(x[i], w[i * wstep], has_where, t, probs[i * pstep],
                                    has_index, eps, valid, scale, want_grad, grad[i * gstep])


# -- vector-Jacobian products ----------------------------------------------------------------


@njit(fastmath=FASTMATH, cache=True)
def softmax_vjp_row(p, c, w, has_where, out):
    """g = p * (c - sum(p * c)) over allowed positions; a zero probability contributes 0."""
    n = p.shape[0]
    zero = like(p, 0.0)
    dot = 0.0
    for j in range(n):
        pj = widen(p[j])
        cj = like(pj, widen(c[j]))
        if has_where and not w[j]:
            pj = zero
            cj = zero
        cj = zero if pj == 0 else cj
        dot += pj * cj
    d = like(zero, dot)
    for j in range(n):
        pj = widen(p[j])
        cj = like(pj, widen(c[j]))
        if has_where and not w[j]:
            pj = zero
            cj = zero
        cj = zero if pj == 0 else cj
        put(out, j, pj * (cj - d))


@njit(parallel=True, cache=True)
def softmax_vjp_par(p, c, w, wstep, has_where, out):
    for i in prange(p.shape[0]):
        softmax_vjp_row(p[i], c[i], w[i * wstep], has_where, out[i])


@njit(cache=True)
def softmax_vjp_ser(p, c, w, wstep, has_where, out):
    for i in range(p.shape[0]):
        softmax_vjp_row(p[i], c[i], w[i * wstep], has_where, out[i])


@njit(fastmath=FASTMATH, cache=True)
def log_softmax_vjp_row(lp, c, w, has_where, out):
    """g = c - exp(log p) * sum(c) over allowed positions (log p > -inf); others 0."""
    n = lp.shape[0]
    total = 0.0
    for j in range(n):
        lj = widen(lp[j])
        if lj != -np.inf and not (has_where and not w[j]):
            total += widen(c[j])
    for j in range(n):
        lj = widen(lp[j])
        if lj != -np.inf and not (has_where and not w[j]):
            cj = like(lj, widen(c[j]))
            put(out, j, cj - np.exp(lj) * like(lj, total))
        else:
            put(out, j, like(lj, 0.0))


@njit(parallel=True, cache=True)
def log_softmax_vjp_par(lp, c, w, wstep, has_where, out):
    for i in prange(lp.shape[0]):
        log_softmax_vjp_row(lp[i], c[i], w[i * wstep], has_where, out[i])


@njit(cache=True)
def log_softmax_vjp_ser(lp, c, w, wstep, has_where, out):
    for i in range(lp.shape[0]):
        log_softmax_vjp_row(lp[i], c[i], w[i * wstep], has_where, out[i])
