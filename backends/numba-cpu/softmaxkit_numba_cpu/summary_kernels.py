"""Compiled kernels for online summaries: summarize, merge, normalize and the attention merge.

Each follows softmaxkit/reference/summary.py (or reference/attention.py for the attention
merge), the executable spec, on 2-D C-contiguous storage rows (:mod:`.bits`); a mask row of
row ``i`` is ``w[i * wstep]`` as in :mod:`.row_kernels`.

``summarize`` reads ``x`` once: a block of :data:`BLOCK` positions is loaded for its maximum
and stays in the L1 cache for the sum of ``exp(x - m)`` that follows, with the running sum
rescaled by ``exp(m_old - m_new)`` when a block raises the maximum (the online recurrence).
Rows are cut into pieces that threads summarize independently, and the pieces merge exactly
(:func:`merge_row`), so a single long row uses every core.  ``normalize`` is elementwise once
the row's ``(max, mass)`` is known, so its threads take tiles of any row.

The empty summary ``(-inf, 0, 0)`` is an exact identity: a part whose maximum equals the
result's gets the factor 1 by a branch, and a maximum of ``-inf`` never enters a subtraction
with another ``-inf``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .bits import like, maxnum, put, widen
from .exp import exp_nonpos

FASTMATH = {"reassoc", "contract", "nsz"}
"""Reassociation lets the sums and maxima vectorize; NaN and infinities keep their meaning."""

BLOCK = 1024
"""Positions per block of ``summarize``: 4 KiB of float32, resident in L1 between two loops."""

TILE = 16384
"""Positions per task of ``normalize``'s threaded loop."""


# -- summarize -------------------------------------------------------------------------------


@njit(fastmath=FASTMATH, cache=True)
def _block_max(x, w, has_where, m):
    """``max(m, allowed x)``, ignoring NaN (lanewise, one reduction at the end).

    The block functions take slices, whose indices start at 0: a loop from a runtime start
    would keep numba's negative-index correction, which stops vectorization.
    """
    if has_where:
        ninf = like(m, -np.inf)
        for j in range(x.shape[0]):
            m = maxnum(m, widen(x[j]) if w[j] else ninf)
    else:
        for j in range(x.shape[0]):
            m = maxnum(m, widen(x[j]))
    return m


@njit(fastmath=FASTMATH, cache=True)
def _block_sum(x, w, has_where, m):
    """``(sum exp(x - m), sum (x - m))`` over the allowed positions of ``x``.

    The second sum is NaN exactly when an allowed logit is NaN (``m`` is finite and no
    logit exceeds it), which saves a NaN test per element.
    """
    zero = like(m, 0.0)
    ninf = like(m, -np.inf)
    s = zero
    chk = zero
    if has_where:
        for j in range(x.shape[0]):
            allowed = w[j]
            z = widen(x[j]) - m if allowed else ninf
            chk += z if allowed else zero
            s += exp_nonpos(z)
    else:
        for j in range(x.shape[0]):
            z = widen(x[j]) - m
            chk += z
            s += exp_nonpos(z)
    return s, chk


@njit(cache=True)
def _block_values(x, w, has_where, m, v, num):
    """``num += sum exp(x - m) * v`` over the allowed positions above -inf of ``x``.

    Excluded positions are skipped, so a NaN or infinite value there cannot leak in.
    """
    for j in range(x.shape[0]):
        if has_where and not w[j]:
            continue
        xj = widen(x[j])
        if xj == -np.inf:
            continue
        e = exp_nonpos(xj - m)
        for d in range(num.shape[0]):
            num[d] += e * widen(v[j, d])


@njit(cache=True)
def _scan(x, w, has_where, lo, hi):
    """``(any allowed NaN, any allowed +inf)`` in ``x[lo:hi]`` (scalar; special rows only)."""
    posinf = False
    for j in range(lo, hi):
        if has_where and not w[j]:
            continue
        v = widen(x[j])
        if v != v:
            return True, posinf
        if v == np.inf:
            posinf = True
    return False, posinf


@njit(cache=True)
def summarize_piece(x, w, has_where, lo, hi, v, has_values, num):
    """The summary ``(max, mass)`` of positions ``[lo, hi)`` of one row; ``num`` the numerator.

    ``max`` is in the accumulator type, ``mass`` and ``num`` (length ``Dv``) in float64.  An
    allowed NaN gives NaN fields, an allowed ``+inf`` (and no NaN) ``(+inf, NaN, NaN)``, no
    allowed position ``(-inf, 0, 0)``.
    """
    m = like(x, -np.inf)
    total = 0.0
    num[:] = 0.0
    for b0 in range(lo, hi, BLOCK):
        b1 = min(b0 + BLOCK, hi)
        xb = x[b0:b1]
        wb = w[b0:b1] if has_where else w
        bm = _block_max(xb, wb, has_where, m)
        if bm == np.inf:
            nan, _ = _scan(x, w, has_where, lo, hi)
            num[:] = np.nan
            return (like(x, np.nan) if nan else bm), np.nan
        if bm == -np.inf:  # nothing finite so far: only a NaN can matter
            nan, _ = _scan(x, w, has_where, b0, b1)
            if nan:
                num[:] = np.nan
                return like(x, np.nan), np.nan
            continue
        if bm > m and m != -np.inf:
            f = math.exp(np.float64(m) - np.float64(bm))
            total *= f
            if has_values:
                num *= f
        m = bm
        s, chk = _block_sum(xb, wb, has_where, m)
        if chk != chk:
            num[:] = np.nan
            return like(x, np.nan), np.nan
        total += np.float64(s)
        if has_values:
            _block_values(xb, wb, has_where, m, v[b0:b1], num)
    return m, total


@njit(parallel=True, cache=True)
def summarize_par(x, w, wstep, has_where, v, vstep, has_values, pm, ps, pnum):
    """Piece ``k`` of row ``i`` into ``pm[k, i]``, ``ps[k, i]``, ``pnum[k, i]``, in parallel.

    ``pm`` is ``[P, R]`` (P pieces per row, cut evenly), so the pieces merge with
    :func:`merge_par` / :func:`merge_ser` as any ``P`` summaries do.
    """
    pieces, r = pm.shape
    n = x.shape[1]
    for t in prange(pieces * r):
        i, k = t // pieces, t % pieces
        m, s = summarize_piece(x[i], w[i * wstep], has_where, k * n // pieces,
                               (k + 1) * n // pieces, v[i * vstep], has_values, pnum[k, i])
        pm[k, i] = m
        ps[k, i] = s


@njit(cache=True)
def summarize_ser(x, w, wstep, has_where, v, vstep, has_values, pm, ps, pnum):
    """One thread, one piece per row: ``pm``, ``ps``, ``pnum`` are ``[1, R, ...]``."""
    n = x.shape[1]
    for i in range(x.shape[0]):
        m, s = summarize_piece(x[i], w[i * wstep], has_where, 0, n, v[i * vstep], has_values,
                               pnum[0, i])
        pm[0, i] = m
        ps[0, i] = s


# -- merge -----------------------------------------------------------------------------------


@njit(cache=True)
def merge_row(maxes, masses, nums, has_num, r, num):
    """Merge the ``S`` summaries of row ``r`` (``maxes[:, r]`` ...) into ``(max, mass)``, ``num``.

    Spec "Merge": ``f = 1`` where a part's maximum is the largest (an empty part next to
    another empty part included), else ``exp(max_s - M)``, and 0 under an infinite ``M``.
    Sums are in float64 and rounded once; a NaN maximum anywhere makes every field NaN.
    """
    top = like(maxes, -np.inf)
    for s in range(maxes.shape[0]):
        v = maxes[s, r]
        if v != v:
            if has_num:
                num[:] = np.nan
            return v, np.nan
        top = max(top, v)
    finite = top - top == 0
    mass = 0.0
    if has_num:
        num[:] = 0.0
    for s in range(maxes.shape[0]):
        v = maxes[s, r]
        if v == top:
            f = 1.0
        elif finite:
            f = math.exp(np.float64(v) - np.float64(top))
        else:
            f = 0.0
        mass += f * np.float64(masses[s, r])
        if has_num:
            for d in range(num.shape[0]):
                num[d] += f * np.float64(nums[s, r, d])
    return top, mass


@njit(cache=True)
def _merge_into(maxes, masses, nums, has_num, r, scratch, om, oms, onum):
    m, mass = merge_row(maxes, masses, nums, has_num, r, scratch)
    om[r] = m
    oms[r] = mass
    if has_num:
        for d in range(scratch.shape[0]):
            onum[r, d] = scratch[d]


@njit(parallel=True, cache=True)
def merge_par(maxes, masses, nums, has_num, om, oms, onum):
    """Merge ``[S, R]`` summaries into ``[R]`` (``onum`` ``[R, Dv]``), rows in parallel."""
    dv = nums.shape[2]
    for r in prange(maxes.shape[1]):
        _merge_into(maxes, masses, nums, has_num, r, np.empty(dv), om, oms, onum)


@njit(cache=True)
def merge_ser(maxes, masses, nums, has_num, om, oms, onum):
    """:func:`merge_par` on one thread."""
    scratch = np.empty(nums.shape[2])
    for r in range(maxes.shape[1]):
        _merge_into(maxes, masses, nums, has_num, r, scratch, om, oms, onum)


# -- normalize -------------------------------------------------------------------------------


@njit(inline="always")
def _cover(z, counted, above, chk, zero):
    """:func:`_normalize_regular`'s two sums after one more position ``z = x - m``: inlined
    into each of its loops, which stay apart so that each vectorizes."""
    return above + (z if z > zero else zero), chk + (z if counted else zero)


@njit(fastmath=FASTMATH, cache=True)
def _normalize_regular(x, w, has_where, m, mass, log, out):
    """``exp(x - m) / mass`` or ``(x - m) - log(mass)`` into ``out``; False if not covered.

    The sums of the positive parts of ``x - m`` and of ``x - m`` come with the same loop
    (a running maximum there would stop it from vectorizing): the summary does not cover
    ``x`` when the first is positive or the second is NaN (an allowed NaN).
    """
    zero = like(m, 0.0)
    ninf = like(m, -np.inf)
    above = zero
    chk = zero
    if log:
        ls = like(m, math.log(mass))
        if has_where:
            for j in range(x.shape[0]):
                allowed = w[j]
                z = widen(x[j]) - m if allowed else ninf
                above, chk = _cover(z, allowed, above, chk, zero)
                put(out, j, z - ls)
        else:
            for j in range(x.shape[0]):
                z = widen(x[j]) - m
                above, chk = _cover(z, True, above, chk, zero)
                put(out, j, z - ls)
    else:
        inv = like(m, 1.0) / like(m, mass)
        if has_where:
            for j in range(x.shape[0]):
                allowed = w[j]
                z = widen(x[j]) - m if allowed else ninf
                above, chk = _cover(z, allowed, above, chk, zero)
                put(out, j, exp_nonpos(z) * inv)
        else:
            for j in range(x.shape[0]):
                z = widen(x[j]) - m
                above, chk = _cover(z, True, above, chk, zero)
                put(out, j, exp_nonpos(z) * inv)
    return above == 0 and chk == chk


@njit(cache=True)
def normalize_span(x, w, has_where, m, mass, log, masked_nan, lo, hi, out):
    """Positions ``[lo, hi)`` of one row against the row's summary ``(m, mass)``.

    Returns False when the summary does not cover the row (spec of ``normalize``).
    """
    nan = like(m, np.nan)
    ninf = like(m, -np.inf)
    if m != m:  # NaN row
        for j in range(lo, hi):
            put(out, j, nan)
        return True
    if m - m == 0:
        return _normalize_regular(x[lo:hi], w[lo:hi] if has_where else w, has_where, m, mass,
                                  log, out[lo:hi])
    ok = True
    for j in range(lo, hi):
        allowed = not has_where or w[j]
        v = widen(x[j])
        if allowed and not v <= m:
            ok = False
        if m == np.inf:  # +inf row: NaN at its +inf positions in log space, else NaN
            put(out, j, (nan if allowed and v == np.inf else ninf) if log else nan)
        elif masked_nan:  # empty row
            put(out, j, nan)
        else:
            put(out, j, ninf if log else like(m, 0.0))
    return ok


@njit(parallel=True, cache=True)
def normalize_par(x, w, wstep, has_where, maxes, masses, log, masked_nan, out, ok):
    """Tiles of :data:`TILE` positions of every row in parallel; ``ok[t]`` per tile."""
    r, n = x.shape
    per_row = max(1, -(-n // TILE))
    for t in prange(r * per_row):
        i, k = t // per_row, t % per_row
        lo, hi = k * TILE, min((k + 1) * TILE, n)
        ok[t] = normalize_span(x[i], w[i * wstep], has_where, maxes[i], masses[i], log,
                               masked_nan, lo, hi, out[i])


@njit(cache=True)
def normalize_ser(x, w, wstep, has_where, maxes, masses, log, masked_nan, out, ok):
    """:func:`normalize_par` on one thread, a row at a time (``ok[i]`` per row)."""
    for i in range(x.shape[0]):
        ok[i] = normalize_span(x[i], w[i * wstep], has_where, maxes[i], masses[i], log,
                               masked_nan, 0, x.shape[1], out[i])


# -- merge of attention states ---------------------------------------------------------------


@njit(cache=True)
def _attention_weights(lses, r, a):
    """``a[s] = exp(lse_s - lse)`` for row ``r`` (0 for empty parts), and the merged lse.

    As the reference: the largest lse ``M``, ``w_s = exp(lse_s - M)`` (exactly 1 at ``M``),
    ``lse = M + log(sum w)``; every part empty gives ``-inf``.  A NaN lse makes the row NaN.
    """
    top = -np.inf
    for s in range(lses.shape[0]):
        v = np.float64(lses[s, r])
        if v != v:
            a[:] = np.nan
            return np.nan
        top = max(top, v)
    finite = top - top == 0
    total = 0.0
    for s in range(lses.shape[0]):
        v = np.float64(lses[s, r])
        if v == -np.inf:
            f = 0.0
        elif v == top:
            f = 1.0
        elif finite:
            f = math.exp(v - top)
        else:
            f = 0.0
        a[s] = f
        total += f
    if total == 0:
        return -np.inf
    for s in range(lses.shape[0]):
        a[s] /= total
    return top + math.log(total)


@njit(cache=True)
def _attention_merge_row(outs, lses, r, a, acc, out, lse):
    lse[r] = _attention_weights(lses, r, a)
    acc[:] = 0.0
    for s in range(outs.shape[0]):
        if a[s] != 0 or a[s] != a[s]:  # empty parts are skipped: their outs are ignored
            for d in range(acc.shape[0]):
                acc[d] += a[s] * np.float64(widen(outs[s, r, d]))
    for d in range(acc.shape[0]):
        put(out[r], d, like(lses, acc[d]))


@njit(parallel=True, cache=True)
def merge_attention_par(outs, lses, out, lse):
    """``out [R, Dv]``, ``lse [R]`` from parts ``outs [S, R, Dv]``, ``lses [S, R]``; parallel."""
    s, _, dv = outs.shape
    for r in prange(outs.shape[1]):
        _attention_merge_row(outs, lses, r, np.empty(s), np.empty(dv), out, lse)


@njit(cache=True)
def merge_attention_ser(outs, lses, out, lse):
    """:func:`merge_attention_par` on one thread."""
    s, _, dv = outs.shape
    a, acc = np.empty(s), np.empty(dv)
    for r in range(outs.shape[1]):
        _attention_merge_row(outs, lses, r, a, acc, out, lse)


@njit(cache=True)
def _attention_vjp_row(outs, lses, dout, dlse, has_dlse, r, a, merged, douts, dlses):
    """``d out_s = a_s dout``, ``d lse_s = a_s (<dout, out_s - out> + dlse)``; 0 if empty."""
    _attention_weights(lses, r, a)
    merged[:] = 0.0
    for s in range(outs.shape[0]):
        if a[s] != 0 or a[s] != a[s]:
            for d in range(merged.shape[0]):
                merged[d] += a[s] * np.float64(widen(outs[s, r, d]))
    extra = np.float64(dlse[r]) if has_dlse else 0.0
    for s in range(outs.shape[0]):
        if a[s] == 0:  # an empty part, or a part that underflowed: gradient 0
            for d in range(merged.shape[0]):
                put(douts[s, r], d, like(lses, 0.0))
            dlses[s, r] = 0.0
            continue
        dot = 0.0
        for d in range(merged.shape[0]):
            g = np.float64(widen(dout[r, d]))
            dot += g * (np.float64(widen(outs[s, r, d])) - merged[d])
            put(douts[s, r], d, like(lses, a[s] * g))
        dlses[s, r] = a[s] * (dot + extra)


@njit(parallel=True, cache=True)
def merge_attention_vjp_par(outs, lses, dout, dlse, has_dlse, douts, dlses):
    """Gradient of :func:`merge_attention_par`, rows in parallel."""
    s, _, dv = outs.shape
    for r in prange(outs.shape[1]):
        _attention_vjp_row(outs, lses, dout, dlse, has_dlse, r, np.empty(s), np.empty(dv),
                           douts, dlses)


@njit(cache=True)
def merge_attention_vjp_ser(outs, lses, dout, dlse, has_dlse, douts, dlses):
    """:func:`merge_attention_vjp_par` on one thread."""
    s, _, dv = outs.shape
    a, merged = np.empty(s), np.empty(dv)
    for r in range(outs.shape[1]):
        _attention_vjp_row(outs, lses, dout, dlse, has_dlse, r, a, merged, douts, dlses)
