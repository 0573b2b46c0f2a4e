"""Reductions across the threads that share one row: a warp (shuffles) or a block.

A row is owned by a *group* of ``threads`` threads: one warp (``threads == 32``, several rows
per block) or the whole block (``threads`` a multiple of 32, one row per block).  Every
function here must be called by every thread of the block (also threads whose row is past the
end), so warp shuffles and barriers are always uniform.  All threads get the same result.

The pair reduction carries the online-softmax summary ``(m, s)``: ``m`` the maximum (NaN if
any value was NaN) and ``s`` the sum of ``exp(v - m)``.  Merging rescales both sums to the
larger maximum; the empty summary (``m = -inf``) is an identity and ``-inf - -inf`` is never
evaluated.
"""

from __future__ import annotations

import functools

from numba import float32, float64

from .primitives import (
    LOG2E,
    NAN,
    NEG_INF,
    POS_INF,
    SIMULATOR,
    cuda,
    device_function,
    exp_f64,
    shfl_xor,
)
from .ptx import ex2, max_nan

if SIMULATOR:
    from .primitives import warp_butterfly


@functools.cache
def exponential(acc_name: str):
    """Device function ``exp(d)`` in the accumulator type.

    float32: ``ex2.approx.ftz`` of ``d * log2 e``; ``d`` is formed first (``x - max``), so the
    argument's rounding error is relative to ``|x - max|``, as the spec's bound assumes.
    """
    if acc_name == "float64":

        def exp(d):
            return exp_f64(d)

    else:

        def exp(d):
            return ex2(float32(d) * float32(LOG2E))

    return device_function(exp)


@functools.cache
def word_terms(acc_name: str, width: int, count: bool):
    """Device function ``add(buf, m, s, c, z) -> (s, c, z)``: the ``width`` values ``v`` of
    ``buf`` added to a thread's sums, ``exp(v - m)`` to ``s`` and, with ``count``, for each
    value above ``-inf``, one to ``c`` and ``v - m`` to ``z``."""
    acc = float64 if acc_name == "float64" else float32
    exp = exponential(acc_name)
    neg_inf, one = acc(NEG_INF), acc(1.0)

    def add(buf, m, s, c, z):
        for v in range(width):
            d = buf[v] - m
            s += exp(d)
            if count and buf[v] > neg_inf:
                c += one
                z += d
        return s, c, z

    return device_function(add, inline=True)


@functools.cache
def thread_max(acc_name: str):
    """Device function ``tmax(a, b)``: the maximum, NaN if either is NaN (``max.NaN.f32``)."""
    if acc_name == "float64":

        def tmax(a, b):
            if a != a or b != b:
                return float64(NAN)
            return a if a >= b else b

    else:

        def tmax(a, b):
            return max_nan(a, b)

    return device_function(tmax)


@functools.cache
def summary_ops(acc_name: str, rest: bool = False):
    """``(nanmax, merge)`` device functions for online summaries in the accumulator type.

    With ``rest`` (logsumexp) the summaries are ``(m, t)`` with ``t = s - 1``, the sum without
    one instance of the maximum, merged by the rule of spec "logsumexp" (empty: ``(-inf, -1)``).
    """
    acc = float64 if acc_name == "float64" else float32
    exp = exponential(acc_name)

    def nanmax(a, b):
        # NaN-propagating maximum: once NaN, stays NaN
        if a != a or b != b:
            return acc(NAN)
        return a if a >= b else b

    nanmax = device_function(nanmax)

    def merge(m1, s1, m2, s2):
        if m1 != m1 or m2 != m2:
            return acc(NAN), acc(0.0)
        m = m1 if m1 >= m2 else m2
        if m == NEG_INF:
            return m, acc(0.0)  # both empty: the identity, no -inf - -inf
        if m == POS_INF:
            return m, acc(1.0)  # a +inf row: the sum is not used
        return m, s1 * exp(m1 - m) + s2 * exp(m2 - m)

    one = acc(1.0)

    def merge_rest(m1, t1, m2, t2):
        if m1 != m1 or m2 != m2:
            return acc(NAN), acc(0.0)
        if m2 > m1:
            return m2, (t1 + one) * exp(m1 - m2) + t2
        if m2 < m1:
            return m1, t1 + (t2 + one) * exp(m2 - m1)
        return m1, t1 + t2 + one  # equal maxima; two empty sides stay (-inf, -1)

    return nanmax, device_function(merge_rest if rest else merge)


SCRATCH = 64
"""Shared accumulator values a block needs for its reductions (two per warp)."""


@device_function
def _add(a, b):
    return a + b


@functools.cache
def group_reducers(threads: int, acc_name: str, rest: bool = False):
    """``(pair_reduce, sum_reduce, max_reduce)`` for groups of ``threads`` threads; with
    ``rest`` the pairs are logsumexp's ``(m, t)`` (:func:`summary_ops`).

    Each takes a shared ``scratch`` array of :data:`SCRATCH` accumulator values, allocated by
    the kernel (shared arrays declared in separately compiled device functions would clash
    at link time).
    """
    nanmax, merge = summary_ops(acc_name, rest)
    warps = max(1, threads // 32)
    block = threads > 32
    # xor offsets within a group: a group smaller than a warp never mixes with its neighbours
    offsets = tuple(o for o in (16, 8, 4, 2, 1) if o < min(threads, 32))

    def warp_pair(m, s):
        for off in offsets:
            om = shfl_xor(m, off)
            os = shfl_xor(s, off)
            m, s = merge(m, s, om, os)
        return m, s

    def warp_sum(v):
        for off in offsets:
            v = v + shfl_xor(v, off)
        return v

    def warp_max(v):
        for off in offsets:
            v = nanmax(v, shfl_xor(v, off))
        return v

    if not offsets:  # a group of one thread: nothing to exchange

        def warp_pair(m, s):
            return m, s

        def warp_sum(v):
            return v

        def warp_max(v):
            return v

    elif SIMULATOR:  # the same butterfly, replayed with two barriers instead of ten

        def warp_pair(m, s):
            return warp_butterfly((m, s), lambda a, b: merge(a[0], a[1], b[0], b[1]), offsets)

        def warp_sum(v):
            return warp_butterfly(v, lambda a, b: a + b, offsets)

        def warp_max(v):
            return warp_butterfly(v, nanmax, offsets)

    warp_pair = device_function(warp_pair)
    warp_sum = device_function(warp_sum)
    warp_max = device_function(warp_max)

    def pair_reduce(m, s, scratch):
        m, s = warp_pair(m, s)
        if block:
            tid = cuda.threadIdx.x
            if tid % 32 == 0:
                scratch[tid // 32] = m
                scratch[32 + tid // 32] = s
            cuda.syncthreads()
            m = scratch[0]
            s = scratch[32]
            for k in range(1, warps):
                m, s = merge(m, s, scratch[k], scratch[32 + k])
            cuda.syncthreads()
        return m, s

    def one_reduce(warp_reduce, combine):
        """The block's reduction of one value: its warps' results combined through
        ``scratch``."""

        def reduce(v, scratch):
            v = warp_reduce(v)
            if block:
                tid = cuda.threadIdx.x
                if tid % 32 == 0:
                    scratch[tid // 32] = v
                cuda.syncthreads()
                v = scratch[0]
                for k in range(1, warps):
                    v = combine(v, scratch[k])
                cuda.syncthreads()
            return v

        return device_function(reduce)

    return (
        device_function(pair_reduce),
        one_reduce(warp_sum, _add),
        one_reduce(warp_max, nanmax),
    )
