"""Online-softmax summaries on the GPU: ``summarize`` rows and ``merge`` summaries exactly.

A summary of a row's allowed logits is ``(max, mass, numerator)`` with
``mass = sum(exp(x - max))`` and ``numerator = sum(exp(x - max) * values)`` in the accumulator
dtype.  The empty summary ``(-inf, 0, 0)`` is the identity of the merge, which rescales each
part by ``exp(old - new)`` (exactly 1 when the maxima are equal, so ``-inf - -inf`` and
``inf - inf`` are never formed).  An allowed NaN poisons the summary; an allowed ``+inf``
gives ``max = +inf`` with NaN mass and numerator (spec/semantics.md, "Summaries").
"""

from __future__ import annotations

import functools

from .intrinsics import NAN, NEG_INF, POS_INF, cuda, device_function, kernel
from .reductions import SCRATCH, exponential
from .rowkernels import _acc, _coordinates, _first_pass
from .storage import VECTOR_WIDTH, loader


@functools.cache
def summarize(kin: str, vector: bool, threads: int, slots: int, rows_per_block: int,
              cached: bool):
    """Kernel ``(x, w, has_where, maxes, masses, n_rows, nw, tiles)``; outputs ``[rows, 1]``."""
    acc_name, acc = _acc(kin)
    _, row_stats = _first_pass(kin, vector, threads, slots, cached, False)
    width = VECTOR_WIDTH[kin] if vector else 1
    values = slots * width
    coordinates = _coordinates(threads, rows_per_block)
    nan, zero = acc(NAN), acc(0.0)

    @kernel(threads * rows_per_block, values, acc_name == "float64")
    def row_kernel(x, w, has_where, maxes, masses, n_rows, nw, tiles):
        lane, r, live = coordinates(n_rows)
        vals = cuda.local.array(values, acc)
        scratch = cuda.shared.array(SCRATCH, acc)
        m, s, _ = row_stats(x[r], w[r if has_where else 0], has_where, live, nw, lane, tiles,
                            vals, scratch)
        if live and lane == 0:
            maxes[r, 0] = m
            if m != m or m == POS_INF:
                masses[r, 0] = nan
            elif m == NEG_INF:
                masses[r, 0] = zero
            else:
                masses[r, 0] = s

    return row_kernel


@functools.cache
def numerators(kin: str):
    """Kernel ``(x, w, has_where, values, maxes, out, n)``: one block per row, threads over
    the value dimension; ``out[r, d] = sum_i exp(x_i - max) * values[r, i, d]`` over the
    allowed positions (an excluded value is never read)."""
    acc_name, acc = _acc(kin)
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
    _, acc = _acc(acc_name)
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
