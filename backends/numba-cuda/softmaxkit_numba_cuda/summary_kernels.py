"""Online-softmax summaries on the GPU: the numerators of ``summarize``, the exact ``merge``
of summaries and ``normalize``, a row's softmax against its summary (the maxima and masses of
``summarize`` come from :func:`.row_kernels.reduce`).

A summary of a row's allowed logits is ``(max, mass, numerator)`` with
``mass = sum(exp(x - max))`` and ``numerator = sum(exp(x - max) * values)`` in the accumulator
dtype.  The empty summary ``(-inf, 0, 0)`` is the identity of the merge, which rescales each
part by ``exp(old - new)`` (exactly 1 when the maxima are equal, so ``-inf - -inf`` and
``inf - inf`` are never formed).  An allowed NaN poisons the summary; an allowed ``+inf``
gives ``max = +inf`` with NaN mass and numerator (spec/semantics.md, "Summaries").
Summaries held in a 16-bit dtype are widened on load and rounded once on store.
"""

from __future__ import annotations

import functools

from .primitives import (
    NAN,
    NEG_INF,
    POS_INF,
    accumulator,
    cuda,
    device_function,
    kernel,
    logarithm,
)
from .reductions import exponential
from .storage import loader, storer


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
def merge(kind: str):
    """Kernel ``(maxes, masses, nums, has_nums, m_out, mass_out, num_out, n_rows, dv)`` with
    one thread per (row, value index); ``maxes``, ``masses`` are ``[S, R]``, ``nums``
    ``[S, R, Dv]``, all of storage dtype ``kind`` (results too), merged in its accumulator."""
    acc_name, acc = accumulator(kind)
    load = loader(kind, acc_name)
    store = storer(kind)
    exp = exponential(acc_name)
    nan, zero, one = acc(NAN), acc(0.0), acc(1.0)

    def factor(old, new):
        if old == new:
            return one
        if new == POS_INF or new == NEG_INF:
            return zero
        return exp(old - new)

    factor = device_function(factor)

    # the parts' loops over three fields: 64 registers keep them from spilling (sm_90)
    @kernel(256, 1, registers=64)
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
            mp = load(maxes[p], r)
            if mp != mp:
                poisoned = True
            elif mp > m:
                m = mp
        if d == 0:
            mass = zero
            for p in range(parts):
                mass += load(masses[p], r) * factor(load(maxes[p], r), m)
            store(m_out, r, nan if poisoned else m)
            store(mass_out, r, nan if poisoned else mass)
        if has_nums and dv > 0:
            total = zero
            for p in range(parts):
                total += load(nums[p, r], d) * factor(load(maxes[p], r), m)
            store(num_out[r], d, nan if poisoned else total)

    return merge_kernel


NORMALIZE_THREADS = 256
NORMALIZE_ITEMS = 4
"""``normalize`` takes a tile of ``THREADS * ITEMS`` positions of one row a block: each
thread reads the row's summary once and handles ``ITEMS`` positions, ``THREADS`` apart (so
a warp's loads are consecutive)."""


@functools.cache
def normalize(kin: str, kout: str, log: bool, masked_nan: bool, has_where: bool):
    """Kernel ``(x, w, maxes, masses, out, uncovered, n, tiles)``: ``out [R, N]`` (storage
    ``kout``) is the softmax, or with ``log`` the log_softmax, of ``x [R, N]`` (storage
    ``kin``) against the summaries ``maxes [R]``, ``masses [R]`` (accumulator of ``kin``).

    Block ``b`` takes tile ``b % tiles`` of row ``b // tiles``.  A position is allowed when
    ``w`` allows it (``has_where``) and its logit is not ``-inf``; excluded positions give 0
    (``-inf``) and are never compared with the maximum.  The maximum classifies the row as
    the row operations do: NaN gives a NaN row, ``+inf`` a NaN softmax row and a log_softmax
    row of ``-inf`` with NaN at the allowed ``+inf`` logits, ``-inf`` an empty row (0 or
    ``-inf``, NaN with ``masked_nan``).  ``uncovered[0]`` is set to 1 where an allowed logit
    is above the maximum or NaN under a maximum that is not NaN: the summary does not cover
    the row (spec "Summaries").
    """
    acc_name, acc = accumulator(kin)
    load = loader(kin, acc_name)
    store = storer(kout)
    exp = exponential(acc_name)
    ln = logarithm(acc_name)
    nan, zero, neg_inf = acc(NAN), acc(0.0), acc(NEG_INF)
    tile = NORMALIZE_THREADS * NORMALIZE_ITEMS

    @kernel(NORMALIZE_THREADS, NORMALIZE_ITEMS, acc_name == "float64")
    def normalize_kernel(x, w, maxes, masses, out, uncovered, n, tiles):
        b = cuda.blockIdx.x
        r = b // tiles
        start = (b - r * tiles) * tile + cuda.threadIdx.x
        m = maxes[r]
        is_nan = m != m
        posinf = m == POS_INF
        regular = not is_nan and not posinf and m != NEG_INF
        # rows whose every position is NaN, whatever their logits
        all_nan = is_nan or (posinf and not log) or (masked_nan and m == NEG_INF)
        scale = zero  # log: log(mass); softmax: mass
        if regular:
            scale = ln(masses[r]) if log else masses[r]
        xr = x[r]
        orow = out[r]
        for j in range(NORMALIZE_ITEMS):
            i = start + j * NORMALIZE_THREADS
            if i < n:
                xi = load(xr, i)
                allowed = xi != NEG_INF
                if has_where:
                    allowed = allowed and w[r, i]
                if allowed and not is_nan and not xi <= m:
                    uncovered[0] = 1
                if all_nan:
                    v = nan
                elif allowed and regular:
                    v = (xi - m) - scale if log else exp(xi - m) / scale
                elif allowed and posinf:  # log only: NaN where the logit is +inf too
                    v = nan if xi == POS_INF else neg_inf
                else:
                    v = neg_inf if log else zero
                store(orow, i, v)

    return normalize_kernel
