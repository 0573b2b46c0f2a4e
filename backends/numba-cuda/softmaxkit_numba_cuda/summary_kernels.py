"""Online-softmax summaries on the GPU: the numerators of ``summarize`` and the exact
``merge`` of summaries (the maxima and masses of ``summarize`` come from
:func:`.row_kernels.reduce`).

A summary of a row's allowed logits is ``(max, mass, numerator)`` with
``mass = sum(exp(x - max))`` and ``numerator = sum(exp(x - max) * values)`` in the accumulator
dtype.  The empty summary ``(-inf, 0, 0)`` is the identity of the merge, which rescales each
part by ``exp(old - new)`` (exactly 1 when the maxima are equal, so ``-inf - -inf`` and
``inf - inf`` are never formed).  An allowed NaN poisons the summary; an allowed ``+inf``
gives ``max = +inf`` with NaN mass and numerator (spec/semantics.md, "Summaries").
"""

from __future__ import annotations

import functools

from .primitives import NAN, NEG_INF, POS_INF, accumulator, cuda, device_function, kernel
from .reductions import exponential
from .storage import loader


@functools.cache
def numerators(kin: str):
    """Kernel ``(x, w, has_where, values, maxes, out, n)``: one block per row, threads over
    the value dimension; ``out[r, d] = sum_i exp(x_i - max) * values[r, i, d]`` over the
    allowed positions (an excluded value is never read)."""
    acc_name, acc = accumulator(kin)
    load = loader(kin, acc_name)
    exp = exponential(acc_name)
    nan, zero = acc(NAN), acc(0.0)

    def numerator(xr, wr, has_where, vr, m, n, d):
        total = zero
        for i in range(n):
            if has_where and not wr[i]:
                continue
            xi = load(xr, i)
            if xi > NEG_INF:
                total += exp(xi - m) * load(vr[i], d)
        return total

    numerator = device_function(numerator)

    @kernel(128, 1)
    def row_kernel(x, w, has_where, values, maxes, out, n):
        r = cuda.blockIdx.x
        m = maxes[r, 0]
        for d in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
            if m != m or m == POS_INF:
                out[r, d] = nan
            elif m == NEG_INF:
                out[r, d] = zero
            else:
                out[r, d] = numerator(x[r], w[r if has_where else 0], has_where, values[r], m,
                                      n, d)

    return row_kernel


@functools.cache
def merge(acc_name: str):
    """Kernel ``(maxes, masses, nums, has_nums, m_out, mass_out, num_out, n_rows, dv)`` with
    one thread per (row, value index); ``maxes``, ``masses`` are ``[S, R]``, ``nums``
    ``[S, R, Dv]``."""
    _, acc = accumulator(acc_name)
    exp = exponential(acc_name)
    nan, zero, one = acc(NAN), acc(0.0), acc(1.0)

    def factor(old, new):
        if old == new:
            return one
        if new == POS_INF or new == NEG_INF:
            return zero
        return exp(old - new)

    factor = device_function(factor)

    @kernel(256, 1)
    def merge_kernel(maxes, masses, nums, has_nums, m_out, mass_out, num_out, n_rows, dv):
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        per_row = dv if has_nums and dv > 0 else 1
        if k >= n_rows * per_row:
            return
        r = k // per_row
        d = k % per_row
        parts = maxes.shape[0]
        m = acc(NEG_INF)
        poisoned = False
        for p in range(parts):
            mp = maxes[p, r]
            if mp != mp:
                poisoned = True
            elif mp > m:
                m = mp
        if d == 0:
            mass = zero
            for p in range(parts):
                mass += masses[p, r] * factor(maxes[p, r], m)
            m_out[r] = nan if poisoned else m
            mass_out[r] = nan if poisoned else mass
        if has_nums and dv > 0:
            total = zero
            for p in range(parts):
                total += nums[p, r, d] * factor(maxes[p, r], m)
            num_out[r, d] = nan if poisoned else total

    return merge_kernel
