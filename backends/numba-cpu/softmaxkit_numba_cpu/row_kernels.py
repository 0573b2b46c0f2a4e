"""Compiled row kernels: one function per row and operation, and the loops over rows.

Every ``*_row`` function follows softmaxkit/reference/rows.py (the executable spec) for one
row; the special rows (:mod:`.lanes`) are written out explicitly so no ``-inf - (-inf)`` or
``inf / inf`` is ever evaluated.  Softmax, log_softmax and logsumexp read each row from
memory once (:func:`~.lanes.summarize`) and write their rows with streaming stores
(:mod:`.stores`); their unmasked rows of at most one block take a shorter path
(:func:`_softmax_short`), which hands any row it cannot finish to the general one.

Each operation has two drivers over rows with one body: ``*_par`` (``prange``, threads as
Numba is set) and ``*_ser`` (one thread, for inputs too small to repay starting the
threads).  The threads of ``*_par`` take batches of about :data:`BATCH_BYTES` of rows from a
shared counter, so one slowed by other work on the machine leaves its rows to the others,
and their scratch arrays are allocated before the parallel loop, one per thread.  Arrays are
2-D C-contiguous storage views (:mod:`.bits`); a mask ``w`` is a 2-D boolean array whose row
``i * wstep`` belongs to row ``i`` (``wstep`` is 0 for a mask shared by all rows).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types, uint64
from numba.extending import overload

from .bits import like, put, widen
from .buffers import ALIGN_FROM
from .exp import exp_nonpos, unlift
from .lanes import (
    BLOCK,
    EMPTY,
    NAN,
    NORMAL,
    POSINF,
    STEP,
    block_rest,
    blocks,
    exp_sum_of,
    log1p_total,
    log_total,
    max_of,
    maxnum_of,
    row_stats,
    summarize,
)
from .stores import (
    LANES,
    aligned_span,
    fence,
    fetch_add,
    stream_scaled,
    stream_shifted,
)


@njit(cache=True)
def _fill(out, value):
    for j in range(out.shape[0]):
        put(out, j, value)


@njit(cache=True)
def _fill_at(out, o0, n, value):
    for t in range(n):
        put(out, o0 + t, value)


# -- streamed row writes -----------------------------------------------------------------
# out[o0:o0 + n] from src[s0:s0 + n]: whole cache lines streamed, the rest stored plainly;
# compiled without reassociation, since h * g may be below the float32 range.  A result
# smaller than STREAM_FROM bytes is stored plainly throughout: it fits in the caches, where
# the allocator's recently freed memory (the last result's) usually still is, and an
# ordinary store there costs half a streaming one (64 x 1024 float32: 5 us against 10).

STREAM_FROM = ALIGN_FROM
"""Results of at least this many bytes are written with streaming stores (they start on a
cache line, :mod:`.buffers`)."""


@njit(fastmath={"contract"}, cache=True)
def _scale_plain(out, o0, src, s0, n, h, g):
    a = uint64(o0)
    b = uint64(s0)
    for t in range(uint64(0), uint64(n)):
        put(out, a + t, (src[b + t] * h) * g)


@njit(fastmath={"contract"}, cache=True)
def scale_into(out, o0, src, s0, n, h, g):
    """``out[o0 + t] = (src[s0 + t] * h) * g`` for ``t < n``, streamed where ``out`` allows."""
    if out.size * out.itemsize < STREAM_FROM:
        _scale_plain(out, o0, src, s0, n, h, g)
        return
    a, b = aligned_span(out, o0, o0 + n)
    _scale_plain(out, o0, src, s0, a - o0, h, g)
    for j in range(a, b, LANES):
        stream_scaled(out, j, src, s0 + (j - o0), h, g)
    _scale_plain(out, b, src, s0 + (b - o0), o0 + n - b, h, g)


@njit(fastmath={"contract"}, cache=True)
def _shift_plain(out, o0, x, s0, n, a, b):
    c = uint64(o0)
    d = uint64(s0)
    for t in range(uint64(0), uint64(n)):
        put(out, c + t, (widen(x[d + t]) - a) - b)


@njit(fastmath={"contract"}, cache=True)
def shift_into(out, o0, x, s0, n, a, b):
    """``out[o0 + t] = (x[s0 + t] - a) - b`` for ``t < n``, streamed where ``out`` allows."""
    if out.size * out.itemsize < STREAM_FROM:
        _shift_plain(out, o0, x, s0, n, a, b)
        return
    first, last = aligned_span(out, o0, o0 + n)
    _shift_plain(out, o0, x, s0, first - o0, a, b)
    for j in range(first, last, LANES):
        stream_shifted(out, j, x, s0 + (j - o0), a, b)
    _shift_plain(out, last, x, s0 + (last - o0), o0 + n - last, a, b)


def scratch_rows(x, rows, n):  # pragma: no cover - replaced by the overload
    """A new ``[rows, n]`` array in the accumulator type of array ``x``."""
    raise NotImplementedError


@overload(scratch_rows, jit_options={"cache": True})
def _scratch_rows(x, rows, n):
    if x.dtype == types.float64:
        return lambda x, rows, n: np.empty((rows, n), dtype=np.float64)
    return lambda x, rows, n: np.empty((rows, n), dtype=np.float32)


# -- threads ---------------------------------------------------------------------------------

BATCH_BYTES = 1 << 16
"""Input bytes a thread takes at a time (whole rows, at least one)."""


@njit(cache=True)
def _batch(x):
    """Rows per batch: about :data:`BATCH_BYTES` of ``x``."""
    return max(1, BATCH_BYTES // max(1, x.shape[1] * x.itemsize))


@njit(cache=True)
def _workers(x, threads):
    """Threads worth starting: at most one per batch of rows, at least one."""
    batches = (x.shape[0] + _batch(x) - 1) // _batch(x)
    return max(1, min(batches, threads))


@njit(cache=True)
def _shared(x, threads):
    """``(workers, batch, counter, bmax, bsum)`` of a parallel driver over the rows of ``x``.

    The block scratch is one row per worker, allocated here, before the parallel loop: Numba
    hoists an allocation out of a ``prange`` body, which would make the workers share it.
    """
    workers = _workers(x, threads)
    width = max(1, blocks(x.shape[1]))
    return (workers, _batch(x), np.zeros(1, dtype=np.int64), np.empty((workers, width)),
            np.empty((workers, width)))


@njit(cache=True)
def _take(counter, batch, r):
    """The next batch of rows ``(lo, hi)`` from the shared counter (``lo == r``: none left)."""
    lo = min(fetch_add(counter, 0, batch), r)
    return lo, min(lo + batch, r)


@njit(cache=True)
def _flat(a):
    """A 2-D C-contiguous array as 1-D (rows are addressed by offsets, see :mod:`.lanes`)."""
    return a.reshape(a.shape[0] * a.shape[1])


# -- softmax ---------------------------------------------------------------------------------


@njit(cache=True)
def softmax_row(x, r0, n, stop, w, q0, has_where, masked_nan, buf, bmax, bsum, out, first):
    """``exp(x - M) / S`` of ``x[r0:r0 + n]`` into ``out[r0:r0 + n]`` (flat arrays).

    The block terms are kept in ``buf`` (in cache).  Block ``b``'s terms are
    ``2**LIFT exp(x - m_b)``; their factor ``exp(m_b - M) / S`` (with the lifted ``S``) is
    applied as ``h * 2**-2LIFT`` so that ``h`` stays a normal number.  Returns the maximum
    of the next row's first block (see :func:`~.lanes.summarize`).
    """
    kind, m, total, after = summarize(x, r0, n, stop, w, q0, has_where, buf, True, bmax, bsum,
                                      first, False)
    if kind == NORMAL:
        u = unlift(m)
        g = like(m, u * u)
        for b in range(blocks(n)):
            b0 = b * BLOCK
            mb = bmax[b]
            f = 1.0 if mb == m else (0.0 if mb == -np.inf else math.exp(mb - np.float64(m)))
            scale_into(out, r0 + b0, buf, b0, min(BLOCK, n - b0), like(m, f / total / (u * u)),
                       g)
    elif kind == EMPTY and not masked_nan:
        _fill_at(out, r0, n, like(m, 0.0))
    else:
        _fill_at(out, r0, n, like(m, np.nan))
    return after


@njit(cache=True)
def _softmax_short(x, n, lo, hi, buf, out):
    """:func:`softmax_row` of the unmasked rows ``lo`` to ``hi`` of at most
    :data:`~.lanes.BLOCK` elements each (``x`` and ``out`` flat), up to the first whose
    maximum or sum is not finite, which it leaves to :func:`softmax_row`: returns that row's
    index (``hi`` when none).

    Three plain passes over each row, the later two from the L1 cache: the next row's read
    is left to the hardware prefetcher, as fast as overlapping it with this row's
    exponentials (:func:`~.lanes.block_exp_next`) on large inputs, and faster on small ones.
    The loops are written here, not called through helpers of several arrays each, which
    cost about 10 ns a row.
    """
    plain = out.size * out.itemsize < STREAM_FROM
    for i in range(lo, hi):
        r0 = i * n
        m = max_of(x, r0, n) if plain else maxnum_of(x, r0, n)  # see maxnum_of
        if m - m != m - m:  # -inf (empty), +inf, or NaN only
            return i
        s = 0.0  # float32 lanes over steps of STEP, added in float64 (as summarize)
        for c in range(0, n, STEP):
            s += exp_sum_of(x, r0 + c, min(STEP, n - c), m, buf, c, True)
        if s != s:
            return i
        u = unlift(m)
        h = like(m, 1.0 / s / (u * u))
        if plain:
            _scale_plain(out, r0, buf, 0, n, h, like(m, u * u))
        else:
            scale_into(out, r0, buf, 0, n, h, like(m, u * u))
    return hi


@njit(cache=True)
def _softmax_rows(x, w, wstep, has_where, masked_nan, out, lo, hi, buf, bmax, bsum):
    n = x.shape[1]
    xs, os, ws = _flat(x), _flat(out), _flat(w)
    first = like(x, np.nan)  # the next row's first block maximum, read with this row
    i = lo
    while i < hi:
        if not has_where and n <= BLOCK:
            j = _softmax_short(xs, n, i, hi, buf, os)
            if j == hi:
                return
            if j != i:  # the read-ahead, if any, was of row i
                first = like(x, np.nan)
            i = j
        first = softmax_row(xs, i * n, n, hi * n, ws, i * wstep * n, has_where, masked_nan,
                            buf, bmax, bsum, os, first)
        i += 1


@njit(parallel=True, cache=True)
def softmax_par(x, w, wstep, has_where, masked_nan, out, threads):
    r, n = x.shape
    workers, batch, counter, bmax, bsum = _shared(x, threads)
    bufs = scratch_rows(x, workers, n)  # one row per worker, as _shared's
    for c in prange(workers):
        lo, hi = _take(counter, batch, r)
        while lo < r:
            _softmax_rows(x, w, wstep, has_where, masked_nan, out, lo, hi, bufs[c], bmax[c],
                          bsum[c])
            lo, hi = _take(counter, batch, r)
        fence()


@njit(cache=True)
def softmax_ser(x, w, wstep, has_where, masked_nan, out):
    r, n = x.shape
    bmax = np.empty(max(1, blocks(n)))
    _softmax_rows(x, w, wstep, has_where, masked_nan, out, 0, r, scratch_rows(x, 1, n)[0],
                  bmax, np.empty_like(bmax))
    fence()


# -- log_softmax -----------------------------------------------------------------------------


@njit(cache=True)
def log_softmax_row(x, r0, n, stop, w, q0, has_where, masked_nan, bmax, bsum, out, first):
    """(x - M) - log(S) of ``x[r0:r0 + n]`` into ``out[r0:r0 + n]``; excluded positions -inf."""
    kind, m, total, after = summarize(x, r0, n, stop, w, q0, has_where, bmax, False, bmax,
                                      bsum, first, False)
    ninf = like(m, -np.inf)
    nan = like(m, np.nan)
    if kind == NORMAL:
        ls = like(m, log_total(m, total))
        if has_where:
            for t in range(n):
                put(out, r0 + t, (widen(x[r0 + t]) - m) - ls if w[q0 + t] else ninf)
        else:
            shift_into(out, r0, x, r0, n, m, ls)
    elif kind == POSINF:
        inf = like(m, np.inf)
        for t in range(n):
            allowed = not has_where or w[q0 + t]
            put(out, r0 + t, nan if allowed and widen(x[r0 + t]) == inf else ninf)
    elif kind == EMPTY and not masked_nan:
        _fill_at(out, r0, n, ninf)
    else:
        _fill_at(out, r0, n, nan)
    return after


@njit(cache=True)
def _log_softmax_short(x, n, lo, hi, out, unused):
    """:func:`log_softmax_row` of unmasked short rows, as :func:`_softmax_short` (the same
    passes, the exponentials summed and not kept; ``unused``: a float64 array, the
    ``buf`` of :func:`~.lanes.exp_sum_of`)."""
    plain = out.size * out.itemsize < STREAM_FROM
    for i in range(lo, hi):
        r0 = i * n
        m = max_of(x, r0, n) if plain else maxnum_of(x, r0, n)
        if m - m != m - m:
            return i
        s = 0.0
        for c in range(0, n, STEP):
            s += exp_sum_of(x, r0 + c, min(STEP, n - c), m, unused, 0, False)
        if s != s:
            return i
        ls = like(m, log_total(m, s))
        if plain:
            _shift_plain(out, r0, x, r0, n, m, ls)
        else:
            shift_into(out, r0, x, r0, n, m, ls)
    return hi


@njit(cache=True)
def _log_softmax_rows(x, w, wstep, has_where, masked_nan, out, lo, hi, bmax, bsum):
    n = x.shape[1]
    xs, os, ws = _flat(x), _flat(out), _flat(w)
    first = like(x, np.nan)
    i = lo
    while i < hi:
        if not has_where and n <= BLOCK:
            j = _log_softmax_short(xs, n, i, hi, os, bmax)
            if j == hi:
                return
            if j != i:
                first = like(x, np.nan)
            i = j
        first = log_softmax_row(xs, i * n, n, hi * n, ws, i * wstep * n, has_where,
                                masked_nan, bmax, bsum, os, first)
        i += 1


@njit(parallel=True, cache=True)
def log_softmax_par(x, w, wstep, has_where, masked_nan, out, threads):
    r = x.shape[0]
    workers, batch, counter, bmax, bsum = _shared(x, threads)
    for c in prange(workers):
        lo, hi = _take(counter, batch, r)
        while lo < r:
            _log_softmax_rows(x, w, wstep, has_where, masked_nan, out, lo, hi, bmax[c],
                              bsum[c])
            lo, hi = _take(counter, batch, r)
        fence()


@njit(cache=True)
def log_softmax_ser(x, w, wstep, has_where, masked_nan, out):
    bmax = np.empty(max(1, blocks(x.shape[1])))
    _log_softmax_rows(x, w, wstep, has_where, masked_nan, out, 0, x.shape[0], bmax,
                      np.empty_like(bmax))
    fence()


# -- logsumexp -------------------------------------------------------------------------------


@njit(cache=True)
def logsumexp_row(x, r0, n, stop, w, q0, has_where, bmax, bsum, first):
    """``(lse, sign, after)`` of ``x[r0:r0 + n]`` without weights (``after``: summarize)."""
    kind, m, total, after = summarize(x, r0, n, stop, w, q0, has_where, bmax, False, bmax,
                                      bsum, first, True)
    if kind == NORMAL:
        # t = S - 1 through log1p: a row with one dominant term keeps the others' share
        return like(m, m + log1p_total(m, total)), like(m, 1.0), after
    if kind == NAN:
        return like(m, np.nan), like(m, np.nan), after
    if kind == POSINF:
        return like(m, np.inf), like(m, 1.0), after
    return like(m, -np.inf), like(m, 0.0), after


@njit(cache=True)
def _logsumexp_short(x, n, lo, hi, w, lse, sign, unused):
    """:func:`logsumexp_row` of unmasked short rows, as :func:`_log_softmax_short`; a
    dominated row is summed again without its maximum (:func:`~.lanes.block_rest`)."""
    for i in range(lo, hi):
        r0 = i * n
        # the maxnum loop: with either loop here, depending on the input's size, the
        # 32768 x 512 float32 logsumexp took 23% more one-thread CPU time (8.2 -> 10.1 ms)
        m = maxnum_of(x, r0, n)
        if m - m != m - m:
            return i
        s = 0.0
        for c in range(0, n, STEP):
            s += exp_sum_of(x, r0 + c, min(STEP, n - c), m, unused, 0, False)
        if s != s:
            return i
        one = 1.0 / unlift(m)  # the maximum's lifted term; s >= 2 one: t = s - 1 is exact
        total = s - one if s >= 2.0 * one else block_rest(x, r0, w, 0, False, n, m, s)
        put(lse, i, like(m, m + log1p_total(m, total)))
        put(sign, i, like(m, 1.0))
    return hi


@njit(cache=True)
def _logsumexp_rows(x, w, wstep, has_where, lse, sign, lo, hi, bmax, bsum):
    n = x.shape[1]
    xs, ws = _flat(x), _flat(w)
    first = like(x, np.nan)
    i = lo
    while i < hi:
        if not has_where and n <= BLOCK:
            j = _logsumexp_short(xs, n, i, hi, ws, lse, sign, bmax)
            if j == hi:
                return
            if j != i:
                first = like(x, np.nan)
            i = j
        value, sg, first = logsumexp_row(xs, i * n, n, hi * n, ws, i * wstep * n, has_where,
                                         bmax, bsum, first)
        put(lse, i, value)
        put(sign, i, sg)
        i += 1


@njit(parallel=True, cache=True)
def logsumexp_par(x, w, wstep, has_where, lse, sign, threads):
    r = x.shape[0]
    workers, batch, counter, bmax, bsum = _shared(x, threads)
    for c in prange(workers):
        lo, hi = _take(counter, batch, r)
        while lo < r:
            _logsumexp_rows(x, w, wstep, has_where, lse, sign, lo, hi, bmax[c], bsum[c])
            lo, hi = _take(counter, batch, r)


@njit(cache=True)
def logsumexp_ser(x, w, wstep, has_where, lse, sign):
    bmax = np.empty(max(1, blocks(x.shape[1])))
    _logsumexp_rows(x, w, wstep, has_where, lse, sign, 0, x.shape[0], bmax,
                    np.empty_like(bmax))


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
    # the weight at the maximum apart from the rest, so a small rest survives (log1p below)
    head = 0.0
    rest = 0.0
    if m != -np.inf:
        for j in range(n):
            bj = b[j]
            if (has_where and not w[j]) or bj == 0:
                continue
            if x[j] == m:
                head += bj
            else:
                rest += exp_nonpos(x[j] - m) * bj
    t = like(b, head + rest)
    sign = like(b, 1.0) if t > 0 else (like(b, -1.0) if t < 0 else zero)
    if t == 0:
        return like(b, -np.inf), sign
    if head != 0 and abs(rest) <= 0.5 * abs(head):
        lse = like(b, math.log(abs(head)) + math.log1p(rest / head)) + m
    else:
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
    ``log p = -inf`` and gradient 0.  A valid ``target`` outside ``[0, n)`` makes the row NaN.
    """
    n = x.shape[0]
    kind, m, s = row_stats(x, w, has_where)
    if (kind == NORMAL and has_index and not has_where and valid and 0 <= target < n
            and widen(x[target]) != -np.inf):
        return _index_row(x, target, m, s, eps, scale, want_grad, grad)
    zero = like(m, 0.0)
    one = like(m, 1.0)
    ninf = like(m, -np.inf)
    unknown = has_index and (target < 0 or target >= n)
    special = kind == NAN or kind == POSINF or unknown
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


@njit(fastmath={"contract", "reassoc"}, cache=True)
def _included(x, m):
    """The count of the classes above -inf and their ``sum (x - m)`` in float64 (summed in
    any order: the terms are all <= 0, and the loop vectorizes)."""
    count = 0
    below = 0.0
    for j in range(x.shape[0]):
        v = widen(x[j])
        keep = v != -np.inf
        count += 1 if keep else 0
        below += np.float64(v - m) if keep else 0.0
    return count, below


@njit(fastmath={"contract"}, cache=True)
def _index_row(x, target, m, s, eps, scale, want_grad, grad):
    """:func:`cross_entropy_row` of the common row: a class index whose logit is above -inf,
    no mask, a finite maximum ``m`` (``s = sum exp(x - m)``).  The loss needs the target's
    log-probability and, with smoothing, the included classes' count and ``sum (x - m)``; the
    gradient is one loop without branches, ``(p - share) * scale``, corrected at the target
    (loops that vectorize, where the general row branches on every element)."""
    n = x.shape[0]
    zero = like(m, 0.0)
    one = like(m, 1.0)
    ls = like(m, math.log(s))
    logp_t = (widen(x[target]) - m) - ls
    share = zero
    keep = one
    if eps == 0:
        loss = -np.float64(logp_t)
    else:
        count, below = _included(x, m)
        share = eps / like(m, count)
        keep = one - eps
        loss = -keep * np.float64(logp_t) + share * (count * np.float64(ls) - below)
    if want_grad:
        inv = one / s
        f = inv * scale
        g = share * scale
        for j in range(uint64(0), uint64(n)):
            put(grad, j, exp_nonpos(widen(x[j]) - m) * f - g)
        if eps != 0:  # excluded classes (-inf logits) have gradient 0, not -share * scale
            for j in range(n):
                if widen(x[j]) == -np.inf:
                    put(grad, j, zero)
        p_t = exp_nonpos(widen(x[target]) - m) * inv
        put(grad, target, (p_t - (keep + share)) * scale)
    return like(m, loss)


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
