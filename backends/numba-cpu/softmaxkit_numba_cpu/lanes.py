"""Per-row reductions shared by the row kernels: the row maximum and the shifted sum.

A row is ``x[r0:r0 + n]`` of a flat storage array ``x`` (see :mod:`.bits`), with an optional
boolean row ``w[q0:q0 + n]`` (``False`` excludes a position, exactly like a logit of -inf).
Rows are addressed by offsets into flat arrays, not by views: a view costs two atomic
reference-count updates, which add up on short rows.  Indices are unsigned, so the compiler
sees no negative index to wrap around (which would keep the loops from vectorizing).

The row is read in blocks of :data:`BLOCK` elements: each block's maximum ``m_b`` and lifted
sum ``s_b = sum(2**LIFT exp(x - m_b))`` (:func:`~softmaxkit_numba_cpu.exp.exp_lifted`) are
taken while the block is in the L1 cache, so the row is read from memory once whatever its
length; the row's maximum is ``M = max m_b`` and its lifted sum ``S = sum s_b exp(m_b - M)``
(float64).  A softmax keeps the block's terms in ``buf`` and scales them by
``exp(m_b - M) / S`` at the end (the seeds' block summary and merge, within one row).
Without a mask, the maximum of the next block (the rest of the row, then the next row) is
taken in steps alternating with the exponentials of the current one, so reading memory
overlaps computing.

:func:`summarize` returns the row's kind and, for an ordinary row, ``M`` and ``S``:

``NORMAL``
    at least one allowed finite logit above -inf, no allowed NaN or +inf;
``NAN``
    an allowed NaN;
``POSINF``
    an allowed +inf and no allowed NaN;
``EMPTY``
    no allowed position above -inf.

The hot loops never test for NaN element by element: the maximum ignores NaN, and the lifted
exponential lets NaN through, so a block with an allowed NaN has a NaN sum.  Only blocks
whose maximum is not finite take the slow scalar classification.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types, uint64
from numba.extending import overload

from .bits import MAX_LANES, MAX_UNROLL, like, maxnum, vector_max, widen
from .exp import exp_lifted, unlift

NORMAL, NAN, POSINF, EMPTY = 0, 1, 2, 3

FASTMATH = {"reassoc", "contract", "nsz"}
"""Reassociation lets the sums vectorize; NaN and infinities keep their IEEE meaning."""

BLOCK = 2048
"""Elements per block: a float32 block and its terms (16 KiB) stay in the 32 KiB L1 cache."""

STEP = 256
"""Elements per step of :func:`block_exp_next`: its exponential and maximum loops alternate."""


@njit(fastmath=FASTMATH, cache=True)
def maxnum_of(x, j0, n):
    """:func:`max_of` as the vectorizer makes the ``llvm.maxnum`` reduction of each element
    (a compare, a blend and a NaN test besides each ``max``).

    The short rows of inputs too large for the caches read the row from memory with this
    loop: with :func:`~.bits.vector_max` there, softmax, log_softmax and logsumexp of a float32
    32768 x 512 input took 15-20% more CPU time (on the 2-core Xeon), although that loop is
    the faster one on data in the caches.
    """
    # maxnum makes the loop a vectorized reduction: lanewise maxima, one at the end
    m = like(x, -np.inf)
    a = uint64(j0)
    for t in range(uint64(0), uint64(n)):
        m = maxnum(m, widen(x[a + t]))
    return m


@njit(cache=True)
def _max_direct(x, j0, n):
    whole = n - n % (MAX_UNROLL * MAX_LANES)  # float64 needs a multiple of half of that
    m = vector_max(x, j0, whole)
    for t in range(j0 + whole, j0 + n):
        v = x[t]
        m = v if v > m else m
    return m


def max_of(x, j0, n):  # pragma: no cover - replaced by the overload inside compiled code
    """Maximum of ``x[j0:j0 + n]`` ignoring NaN (-inf for none), in the accumulator type.

    float32 and float64 take :func:`~.bits.vector_max`, one ``max`` instruction per vector;
    16-bit storage is widened element by element.
    """
    raise NotImplementedError


@overload(max_of, jit_options={"cache": True})
def _max_of(x, j0, n):
    if x.dtype == types.float32 or x.dtype == types.float64:
        return lambda x, j0, n: _max_direct(x, j0, n)
    return lambda x, j0, n: maxnum_of(x, j0, n)


@njit(fastmath=FASTMATH, cache=True)
def exp_sum_of(x, j0, n, m, buf, k0, store):
    """``sum(2**LIFT exp(x[j0:j0 + n] - m))``; with ``store`` the terms go to ``buf[k0:]``."""
    s = like(m, 0.0)
    a = uint64(j0)
    if store:
        b = uint64(k0)
        for t in range(uint64(0), uint64(n)):
            e = exp_lifted(widen(x[a + t]) - m)
            buf[b + t] = e
            s += e
    else:
        for t in range(uint64(0), uint64(n)):
            s += exp_lifted(widen(x[a + t]) - m)
    return s


@njit(fastmath=FASTMATH, cache=True)
def exp_rest_of(x, j0, n, m):
    """``(sum(2**LIFT exp(v - m)) over v < m, count of v == m)`` of ``x[j0:j0 + n]``.

    The terms at the maximum are counted, not summed, so a small rest keeps its precision
    (spec "logsumexp", ``t = S - 1``).  Both sums vectorize: a compare, a multiply-add and an
    add per element beyond the plain sum.
    """
    s = like(m, 0.0)
    c = like(m, 0.0)
    zero = like(m, 0.0)
    one = like(m, 1.0)
    a = uint64(j0)
    for t in range(uint64(0), uint64(n)):
        v = widen(x[a + t])
        at_max = v == m
        # a select, not "+ term - 1": under fast math the compiler may reassociate a sum
        # and a cancelling subtraction, and lose the small rest to the rounding at the 1
        s += zero if at_max else exp_lifted(v - m)
        c += one if at_max else zero
    return s, c


@njit(fastmath=FASTMATH, cache=True)
def masked_exp_rest_of(x, j0, w, q0, n, m):
    """:func:`exp_rest_of` over the positions of ``x[j0:j0 + n]`` allowed by ``w[q0:q0 + n]``."""
    s = like(m, 0.0)
    c = like(m, 0.0)
    zero = like(m, 0.0)
    one = like(m, 1.0)
    ninf = like(m, -np.inf)
    a = uint64(j0)
    q = uint64(q0)
    for t in range(uint64(0), uint64(n)):
        v = widen(x[a + t]) if w[q + t] else ninf
        at_max = v == m
        s += zero if at_max else exp_lifted(v - m)  # a select: see exp_rest_of
        c += one if at_max else zero
    return s, c


@njit(fastmath=FASTMATH, cache=True)
def masked_max_of(x, j0, w, q0, n):
    """:func:`max_of` over the positions of ``x[j0:j0 + n]`` allowed by ``w[q0:q0 + n]``."""
    m = like(x, -np.inf)
    ninf = like(x, -np.inf)
    a = uint64(j0)
    c = uint64(q0)
    for t in range(uint64(0), uint64(n)):
        m = maxnum(m, widen(x[a + t]) if w[c + t] else ninf)
    return m


@njit(fastmath=FASTMATH, cache=True)
def masked_exp_sum_of(x, j0, w, q0, n, m, buf, k0, store):
    """:func:`exp_sum_of` with excluded positions adding (and storing) nothing."""
    s = like(m, 0.0)
    ninf = like(m, -np.inf)
    a = uint64(j0)
    c = uint64(q0)
    b = uint64(k0)
    for t in range(uint64(0), uint64(n)):
        e = exp_lifted(widen(x[a + t]) - m if w[c + t] else ninf)
        if store:
            buf[b + t] = e
        s += e
    return s


@njit(fastmath=FASTMATH, cache=True)
def block_exp_next(x, j0, n, m, buf, k0, store, n0, nn):
    """:func:`exp_sum_of` of ``x[j0:j0 + n]``, and the maximum of ``x[n0:n0 + nn]``.

    The two alternate in steps of :data:`STEP` elements, so the next block is read from
    memory (by these loads and the hardware prefetcher they start) while this block's
    exponentials are computed, not after.  (One loop doing both does not vectorize.)
    """
    s = 0.0
    mn = like(m, -np.inf)
    for c in range(0, max(n, nn), STEP):
        s += exp_sum_of(x, j0 + c, max(0, min(STEP, n - c)), m, buf, k0 + c, store)
        mn = maxnum(mn, max_of(x, n0 + c, max(0, min(STEP, nn - c))))
    return like(m, s), mn


@njit(cache=True)
def special_kind(x, j0, w, q0, has_where, n):
    """Classify ``x[j0:j0 + n]``: NAN, POSINF or EMPTY (a scalar loop, for rare blocks)."""
    posinf = False
    for t in range(n):
        if has_where and not w[q0 + t]:
            continue
        v = widen(x[j0 + t])
        if v != v:
            return NAN
        if v == np.inf:
            posinf = True
    return POSINF if posinf else EMPTY


@njit(cache=True)
def block_rest(x, j0, w, q0, has_where, n, m, s):
    """The block's ``t = S - 1`` (lifted, float64) from its lifted sum ``s`` and maximum ``m``.

    Where the maximum's 1 is at most half of ``s`` (``s >= 2``), ``s - 1`` is exact and as
    precise as ``s``.  Otherwise the block is dominated by one term and ``s`` was rounded at
    it, so ``t`` is summed again without the terms at the maximum (:func:`exp_rest_of`), from
    the block still in the L1 cache: only dominated blocks pay this second pass.
    """
    one = 1.0 / unlift(m)
    if s >= 2.0 * one:
        return s - one
    if has_where:
        part, top = masked_exp_rest_of(x, j0, w, q0, n, m)
    else:
        part, top = exp_rest_of(x, j0, n, m)
    return np.float64(part) + (np.float64(top) - 1.0) * one


@njit(cache=True)
def _block_max(x, j0, w, q0, has_where, n):
    return masked_max_of(x, j0, w, q0, n) if has_where else max_of(x, j0, n)


@njit(cache=True)
def summarize(x, r0, n, stop, w, q0, has_where, buf, store, bmax, bsum, first, rest):
    """``(kind, M, S, after)`` of the row ``x[r0:r0 + n]`` (``S`` lifted, float64).

    With ``rest`` (logsumexp), ``S`` is instead ``t = S - 1`` lifted, the sum without one
    instance of the maximum, whose precision a sum rounded at 1 would lose (spec
    "logsumexp"): each block's (:func:`block_rest`), merged by the spec's rule.

    ``x`` is flat storage in which the rows of this batch end at ``stop``; ``w[q0:q0 + n]``
    is the row's mask when ``has_where``.  Without a mask the maximum of each block is taken
    while the previous block's exponentials are computed: ``first`` is the maximum of this
    row's first block when the previous row took it (NaN otherwise) and ``after`` is the
    maximum of the next row's first block (NaN when not taken).  ``bmax`` and ``bsum``
    (float64, at least one per block) receive each block's maximum and lifted sum; with
    ``store``, ``buf[:n]`` receives the terms ``2**LIFT exp(x - m_b)`` of each block (0 in a
    block with no allowed finite logit).
    """
    nb = (n + BLOCK - 1) // BLOCK
    m = like(x, -np.inf)
    zero = like(x, 0.0)
    nan = like(x, np.nan)
    mb = first
    if has_where or mb != mb:
        mb = _block_max(x, r0, w, q0, has_where, min(BLOCK, n))
    special = False
    for b in range(nb):
        b0 = b * BLOCK
        size = min(BLOCK, n - b0)
        # the next block: the rest of this row, then the first block of the next row
        n0 = r0 + b0 + size
        nn = min(min(BLOCK, n - b0 - size) if b + 1 < nb else min(BLOCK, n), stop - n0)
        bmax[b] = mb
        bsum[b] = zero
        if mb - mb == mb - mb:  # finite
            if has_where:
                bsum[b] = masked_exp_sum_of(x, r0 + b0, w, q0 + b0, size, mb, buf, b0, store)
                nxt = nan
                if b + 1 < nb:
                    nxt = masked_max_of(x, n0, w, q0 + b0 + size, nn)
            else:
                bsum[b], nxt = block_exp_next(x, r0 + b0, size, mb, buf, b0, store, n0, nn)
            if rest:
                bsum[b] = block_rest(x, r0 + b0, w, q0 + b0, has_where, size, mb, bsum[b])
            m = maxnum(m, mb)
            mb = nxt
            continue
        # no allowed finite logit: all -inf (excluded), or NaN / +inf somewhere
        if mb == np.inf or special_kind(x, r0 + b0, w, q0 + b0, has_where, size) != EMPTY:
            special = True
            break
        if store:
            for t in range(size):
                buf[b0 + t] = zero
        if has_where:
            mb = masked_max_of(x, n0, w, q0 + b0 + size, nn) if b + 1 < nb else nan
        else:
            mb = max_of(x, n0, nn)
    after = nan if has_where or special else mb
    if special or m == -np.inf:
        return special_kind(x, r0, w, q0, has_where, n), m, 0.0, after
    total = 0.0
    if rest:
        # the merge of the blocks' (m_b, t_b): t = sum of t_b at the maximum, plus one for each
        # further block at it, plus (t_b + 1) exp(m_b - M) for the others
        one = 1.0 / unlift(m)
        tops = -1.0
        for b in range(nb):
            if bmax[b] == m:
                total += bsum[b]
                tops += 1.0
            elif bmax[b] != -np.inf:
                total += (bsum[b] + one) * math.exp(bmax[b] - np.float64(m))
        total += tops * one
    else:
        for b in range(nb):
            if bmax[b] == m:  # the common case, and every row of one block
                total += bsum[b]
            elif bmax[b] != -np.inf:
                total += bsum[b] * math.exp(bmax[b] - np.float64(m))
    if total != total:  # an allowed NaN in a block with a finite maximum
        return NAN, m, total, after
    return NORMAL, m, total, after


@njit(cache=True)
def log1p_total(v, total):
    """``log1p(t * 2**-LIFT)`` of a lifted ``t = S - 1`` (float64): the log of the real sum."""
    return math.log1p(total * unlift(v))


@njit(cache=True)
def log_total(v, total):
    """``log(S * 2**-LIFT)``, the log of the real sum of a lifted sum ``S`` (float64).

    The power of two is removed before the log (exactly), not subtracted after it, which
    would cost the absolute error of a log near ``LIFT * ln 2``.
    """
    return math.log(total * unlift(v))


def blocks(n):  # pragma: no cover - replaced by the overload inside compiled code
    """Number of blocks of a row of ``n`` elements."""
    return (n + BLOCK - 1) // BLOCK


@overload(blocks, jit_options={"cache": True})
def _blocks(n):
    if isinstance(n, types.Integer):
        return lambda n: (n + BLOCK - 1) // BLOCK
    return None


@njit(cache=True)
def row_stats(x, w, has_where):
    """``(kind, m, s)`` of one row with ``s = sum(exp(x - m))`` (real, not lifted).

    For kernels that take one row at a time (cross-entropy); it allocates its block scratch.
    """
    n = x.shape[0]
    nb = max(1, blocks(n))
    bmax = np.empty(nb, dtype=np.float64)
    bsum = np.empty(nb, dtype=np.float64)
    kind, m, total, _ = summarize(x, 0, n, n, w, 0, has_where, bmax, False, bmax, bsum,
                                  like(x, np.nan), False)
    s = total * unlift(m) if kind == NORMAL else 0.0
    return kind, m, like(m, s)
