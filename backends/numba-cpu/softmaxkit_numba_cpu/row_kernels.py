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

from .bits import like, put, scratch, widen
from .exp import exp_nonpos
from .lanes import EMPTY, NAN, NORMAL, POSINF, row_stats


@njit(cache=True)
def _fill(out, value):
    for j in range(out.shape[0]):
        put(out, j, value)


# -- softmax ---------------------------------------------------------------------------------


@njit(cache=True)
def softmax_row(x, w, has_where, masked_nan, buf, out):
    """exp(x - m) / s: the exponentials go to ``buf`` (accumulator type, in cache), then out."""
    kind, m, s = row_stats(x, w, has_where, buf, True)
    if kind == NORMAL:
        inv = like(m, 1.0) / s
        for j in range(x.shape[0]):
            put(out, j, buf[j] * inv)
    elif kind == EMPTY and not masked_nan:
        _fill(out, like(m, 0.0))
    else:
        _fill(out, like(m, np.nan))


@njit(parallel=True, cache=True)
def softmax_par(x, w, wstep, has_where, masked_nan, out, threads):
    r, n = x.shape
    chunks = min(r, 4 * threads)
    for c in prange(chunks):
        buf = scratch(x, n)  # one buffer per chunk of rows
        for i in range(c * r // chunks, (c + 1) * r // chunks):
            softmax_row(x[i], w[i * wstep], has_where, masked_nan, buf, out[i])


@njit(cache=True)
def softmax_ser(x, w, wstep, has_where, masked_nan, out):
    buf = scratch(x, x.shape[1])
    for i in range(x.shape[0]):
        softmax_row(x[i], w[i * wstep], has_where, masked_nan, buf, out[i])


# -- log_softmax -----------------------------------------------------------------------------


@njit(cache=True)
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


@njit(cache=True)
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

    Scalar code (the weighted form is off the fast path); ``x`` and ``b`` are in the
    accumulator.  A NaN weight on an allowed position makes the row NaN; a +inf row is
    +inf with the sign of the weights at its +inf positions (NaN when they disagree).
    """
    n = x.shape[0]
    zero = like(b, 0.0)
    m = like(b, -np.inf)
    has_nan = False
    posinf = False
    nan_b = False
    up = False
    down = False
    for j in range(n):
        bj = b[j]
        v = x[j]
        if (has_where and not w[j]) or bj == 0:
            continue
        if bj != bj:  # NaN * exp(-inf) is NaN: a NaN weight is never excluded by its logit
            nan_b = True
        if v == -np.inf:
            continue
        if v != v:
            has_nan = True
        elif v == np.inf:
            posinf = True
            up = up or bj > 0
            down = down or bj < 0
        elif v > m:
            m = v
    if has_nan:
        return like(b, np.nan), like(b, np.nan)
    if posinf:
        if nan_b or (up and down):
            return like(b, np.nan), like(b, np.nan)
        if down and not return_sign:
            return like(b, np.nan), like(b, -1.0)
        return like(b, np.inf), like(b, -1.0) if down else like(b, 1.0)
    if nan_b:
        return like(b, np.nan), like(b, np.nan)
    total = 0.0
    if m != -np.inf:
        for j in range(n):
            bj = b[j]
            if (has_where and not w[j]) or bj == 0:
                continue
            total += exp_nonpos(x[j] - m) * bj
    t = like(b, total)
    sign = like(b, 1.0) if t > 0 else (like(b, -1.0) if t < 0 else zero)
    if t == 0:
        return like(b, -np.inf), sign
    lse = like(b, math.log(abs(t))) + m
    if not return_sign and t < 0:
        lse = like(b, np.nan)
    return lse, sign


@njit(cache=True)
def logsumexp_b_ser(x, b, w, wstep, has_where, return_sign, lse, sign):
    for i in range(x.shape[0]):
        value, sg = logsumexp_b_row(x[i], b[i], w[i * wstep], has_where, return_sign)
        put(lse, i, value)
        put(sign, i, sg)


# -- cross entropy ---------------------------------------------------------------------------


@njit(cache=True)
def cross_entropy_row(x, w, has_where, target, probs, has_index, eps, valid, scale, want_grad,
                      grad):
    """Loss ``-sum_{y != 0} y log p`` and, if ``want_grad``, ``grad = scale * (p - y)``.

    ``y`` is the one-hot of ``target`` (``has_index``) or ``probs``, smoothed by ``eps`` over
    the included classes (allowed by ``w``, logit above -inf); excluded classes have
    ``log p = -inf`` and gradient 0.
    """
    n = x.shape[0]
    kind, m, s = row_stats(x, w, has_where, x, False)
    zero = like(m, 0.0)
    one = like(m, 1.0)
    ninf = like(m, -np.inf)
    special = kind == NAN or kind == POSINF
    count = 0
    for j in range(n):
        count += 1 if (not has_where or w[j]) and widen(x[j]) != -np.inf else 0
    share = eps / like(m, count if count else 1)
    keep = one - eps
    ls = like(m, math.log(s)) if kind == NORMAL else zero
    loss = 0.0
    for j in range(n):
        included = (not has_where or w[j]) and widen(x[j]) != -np.inf
        y = (one if j == target else zero) if has_index else probs[j]
        if eps != 0:
            y = keep * y + (share if included else zero)
        if y != 0:
            logp = (widen(x[j]) - m) - ls if included else ninf
            loss -= y * logp
    out = like(m, loss)
    if special:
        out = like(m, np.nan)
    if not valid:
        out = zero
    if want_grad:
        if not valid:
            _fill(grad, zero)
        elif special:
            _fill(grad, like(m, np.nan))
        else:
            inv = one / s if kind == NORMAL else zero
            for j in range(n):
                included = (not has_where or w[j]) and widen(x[j]) != -np.inf
                y = (one if j == target else zero) if has_index else probs[j]
                if eps != 0:
                    y = keep * y + (share if included else zero)
                p = exp_nonpos(widen(x[j]) - m) * inv if included else zero
                put(grad, j, (p - y) * scale if included else zero)
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


@njit(cache=True)
def softmax_vjp_row(p, c, w, has_where, out):
    """g = p * (c - sum(p * c)); positions excluded by ``w`` or with p == 0 take no part."""
    n = p.shape[0]
    zero = like(p, 0.0)
    dot = 0.0
    for j in range(n):
        pj = widen(p[j])
        part = pj != 0 and not (has_where and not w[j])
        dot += pj * like(pj, widen(c[j])) if part else zero
    d = like(zero, dot)
    for j in range(n):
        pj = widen(p[j])
        part = pj != 0 and not (has_where and not w[j])
        put(out, j, pj * (like(pj, widen(c[j])) - d) if part else zero)


@njit(parallel=True, cache=True)
def softmax_vjp_par(p, c, w, wstep, has_where, out):
    for i in prange(p.shape[0]):
        softmax_vjp_row(p[i], c[i], w[i * wstep], has_where, out[i])


@njit(cache=True)
def softmax_vjp_ser(p, c, w, wstep, has_where, out):
    for i in range(p.shape[0]):
        softmax_vjp_row(p[i], c[i], w[i * wstep], has_where, out[i])


@njit(cache=True)
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
